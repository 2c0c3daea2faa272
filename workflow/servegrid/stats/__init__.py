"""Statistics without I/O: percentiles and intervals (numpy/scipy), and the sequential sampling rule."""
