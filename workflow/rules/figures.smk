"""Summary table → figures, per language (PNG, for the HTML and the PDF report alike)."""


rule figures:
    input:
        # The tables the figures read, as servegrid.reporting.figure_files declares them.
        **RUN_TABLES.named(figure_files.TABLES_READ),
        catalogue="report/locales/{lang}/LC_MESSAGES/messages.po",
    output:
        figure_files.figure_paths(EXPERIMENT, paths.FIGURES_LANG_DIR),
    log:
        "results/logs/figures/{lang}.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
        # Labels, order, baseline and objectives are drawn: editing one redraws the figures (nothing upstream).
        shown=canonical_json(EXPERIMENT.figure_presentation()),
    script:
        "../scripts/figures.py"
