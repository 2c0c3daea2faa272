"""Summary table → figures (PNG for the HTML report, SVG for the PDF)."""


rule figures:
    input:
        summary=paths.SUMMARY_TABLE,
    output:
        figure_paths(EXPERIMENT, paths.FIGURES_DIR),
    log:
        "results/logs/figures.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    script:
        "../scripts/figures.py"
