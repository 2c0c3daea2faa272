"""Summary table → figures (PNG for the HTML report, SVG for the PDF)."""


rule figures:
    input:
        summary=paths.SUMMARY_TABLE,
    output:
        figure_paths(EXPERIMENT, paths.FIGURES_DIR),
    params:
        out_dir=paths.FIGURES_DIR,
    log:
        "results/logs/figures.log",
    script:
        "../scripts/figures.py"
