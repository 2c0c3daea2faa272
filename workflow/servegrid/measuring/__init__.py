"""Measuring one cell against a running server: the streaming client, its self-watch, the measured phase, and
what the gateway changes, checked before a proxied cell."""
