"""Server specifications (cheap DAG nodes) and per-configuration teardown.

A running server is never a DAG node: cells start or reuse it through
servegrid.server, so its presence or absence makes nothing stale.
"""


rule server_spec:
    input:
        model_inputs,
    output:
        paths.SERVER_SPEC_PATTERN,
    params:
        spec=launch_spec,
    log:
        "results/logs/servers/{configuration}/spec.log",
    script:
        "../scripts/write_spec.py"


rule server_stop:
    input:
        cells_of_configuration,
    output:
        paths.SERVER_STOP_PATTERN,
    priority: stop_priority
    log:
        "results/logs/servers/{configuration}/stop.log",
    script:
        "../scripts/stop_server.py"
