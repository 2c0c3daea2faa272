"""Tables + figures → one HTML and one PDF report per language."""


rule report_document:
    input:
        summary=paths.SUMMARY_TABLE,
        comparisons=paths.COMPARISONS_TABLE,
        servers=paths.SERVERS_TABLE,
        figures=figure_paths(EXPERIMENT, paths.FIGURES_LANG_DIR),
        verdict=paths.VERDICT_TABLE,
        crossovers=paths.CROSSOVERS_TABLE,
        production=paths.PRODUCTION_TABLE,
        templates=REPORT_TEMPLATES,
        catalogue="report/locales/{lang}/LC_MESSAGES/messages.po",
    output:
        html=paths.REPORT_HTML_PATTERN,
        pdf=paths.REPORT_PDF_PATTERN,
    log:
        "results/logs/report/{lang}.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        figures_dir=lambda wildcards, input: os.path.dirname(input.figures[0]),
        # The title, hardware, labels, flags and settings the report prints: editing one rebuilds the reports.
        shown=canonical_json(EXPERIMENT.presentation()),
    script:
        "../scripts/render_report.py"
