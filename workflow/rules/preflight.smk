"""Before the first server starts: every configuration through the engine's own parser and configuration, the
checkpoint and the host (servegrid preflight, docs/gpu-host.md). An error stops the run before any weights load.

It runs where Snakemake runs (a local rule): on a cluster its GPU checks see the submitting host's GPUs, if any.
The specs take its report as ancient(): a preflight that reruns (a config edit, a new GPU) reruns nothing else.
"""


localrules:
    preflight,


rule preflight:
    input:
        model_inputs,
    output:
        paths.PREFLIGHT_REPORT,
    log:
        "results/logs/preflight.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        servers=preflight_settings,
    script:
        "../scripts/run_preflight.py"
