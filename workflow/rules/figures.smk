"""Summary table → figures, per language (PNG, for the HTML and the PDF report alike)."""


rule figures:
    input:
        summary=paths.SUMMARY_TABLE,
        comparisons=paths.COMPARISONS_TABLE,
        requests=paths.REQUESTS_TABLE,
        gateway=paths.GATEWAY_TABLE,
        catalogue="report/locales/{lang}/LC_MESSAGES/messages.po",
    output:
        figure_paths(EXPERIMENT, paths.FIGURES_LANG_DIR),
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
