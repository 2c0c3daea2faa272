"""Tables + figures → one HTML and one PDF report per language."""


rule report_document:
    input:
        summary=paths.SUMMARY_TABLE,
        comparisons=paths.COMPARISONS_TABLE,
        servers=paths.SERVERS_TABLE,
        figures=figure_paths(EXPERIMENT, paths.FIGURES_DIR),
        templates=REPORT_TEMPLATES,
        catalogue="report/locales/{lang}/LC_MESSAGES/messages.po",
    output:
        html=paths.REPORT_DIR + "/servegrid-{lang}.html",
        pdf=paths.REPORT_DIR + "/servegrid-{lang}.pdf",
    params:
        figures_dir=paths.FIGURES_DIR,
    log:
        "results/logs/report/{lang}.log",
    script:
        "../scripts/render_report.py"
