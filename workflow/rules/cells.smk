"""One job per grid cell: configuration × mode × context × concurrency."""


rule cell:
    input:
        spec=paths.SERVER_SPEC_PATTERN,
    output:
        ensure(paths.CELL_PATTERN, non_empty=True),
    params:
        settings=cell_settings,
    priority: cell_priority
    log:
        "results/logs/cells/{configuration}/{mode}/ctx{context}_c{concurrency}.log",
    script:
        "../scripts/run_cell.py"
