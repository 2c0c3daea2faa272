"""Test and calibration tools: the calibration server and the engine that speaks its own dialect.

Nothing here is ever imported by the pipeline; the tests, the benchmarks and
their configs use it. The calibration server stands in for an inference server
only where a scripted one is the point (client timing, validity flags,
lifecycle), never in a measurement of serving configurations.
"""
