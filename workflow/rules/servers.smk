"""Server specifications (cheap DAG nodes) and per-configuration teardown.

A running server is never a DAG node: cells start or reuse it through
servegrid.serving.server, so its presence or absence makes nothing stale.
"""


# Writing a configuration's spec is the moment before its server can first start: the job runs servegrid preflight
# for that configuration (operations.preflight), with the user's vLLM, where the server will run (on a cluster, the
# configuration's node). It reruns exactly when the spec does: a new server is due then. Its report
# (paths.PREFLIGHT_PATTERN) is no declared output: a new output would rerun every spec of an earlier run, and with
# them every cell.
rule server_spec:
    input:
        model_inputs,
    output:
        paths.SERVER_SPEC_PATTERN,
    log:
        "results/logs/servers/{configuration}/spec.log",
    priority: spec_priority
    conda:
        "../../envs/pipeline.yaml"
    # The cells' device slots too: with several cores, a later configuration whose spec happened to be
    # written first would otherwise get the device before an earlier one, whose server then interrupts it.
    resources:
        **device_slots(),
        **slurm_job(startup_runtime_s),
    params:
        spec=launch_spec,
    script:
        "../scripts/write_spec.py"


rule server_stop:
    input:
        cells_of_configuration,
    output:
        paths.SERVER_STOP_PATTERN,
    log:
        "results/logs/servers/{configuration}/stop.log",
    priority: stop_priority
    conda:
        "../../envs/pipeline.yaml"
    resources:
        **device_slots(),
        **slurm_job(shutdown_runtime_s),
    script:
        "../scripts/stop_server.py"
