"""The tables for other tools: CSV beside the Parquet, and each cell as a vllm bench serve result."""


rule export:
    input:
        requests=paths.REQUESTS_TABLE,
        summary=paths.SUMMARY_TABLE,
    output:
        bench=directory(paths.BENCH_EXPORT_DIR),
        summary_csv=paths.SUMMARY_CSV,
        requests_csv=paths.REQUESTS_CSV,
    log:
        "results/logs/export.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        model=EXPERIMENT.model.served_name,  # the results' model_id
    script:
        "../scripts/export.py"
