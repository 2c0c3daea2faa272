"""One job per grid cell: configuration × mode × context × load (sessions c<N> or rate r<requests/s>)."""


rule cell:
    input:
        spec=paths.SERVER_SPEC_PATTERN,
    output:
        ensure(paths.CELL_PATTERN, non_empty=True),
    log:
        paths.CELL_LOG_PATTERN,
    priority: cell_priority
    conda:
        "../../envs/pipeline.yaml"
    resources:
        **device_slots(),
        **slurm_job(cell_runtime_s, keeps_the_server=True),
    params:
        settings=cell_settings,
    script:
        "../scripts/run_cell.py"
