"""The processes servegrid runs: inference servers and the gateway, their supervisor, state, claims and placement.

A server is launched under its own supervisor (:mod:`~servegrid.serving.supervisor`), recorded in the per-host
state folder (:mod:`~servegrid.serving.state`), reused by every cell of its configuration and stopped by its
owner's end, however that comes (docs/architecture.md draws the whole lifecycle).
"""
