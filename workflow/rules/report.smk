"""Tables + figures → per language an HTML page and a PDF (report.formats), each its own job: a host
without the PDF stack (Pango) still gets its HTML report, and only the PDF job fails, saying why.
"""


rule report_html:
    input:
        unpack(report_inputs),
    output:
        paths.REPORT_PATTERN.replace("{ext}", "html"),
    log:
        "results/logs/report/{lang}.html.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        figures_dir=lambda wildcards, input: os.path.dirname(input.figures[0]),
        shown=REPORT_SHOWN,
    script:
        "../scripts/render_report.py"


rule report_pdf:
    input:
        unpack(report_inputs),
    output:
        paths.REPORT_PATTERN.replace("{ext}", "pdf"),
    log:
        "results/logs/report/{lang}.pdf.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        figures_dir=lambda wildcards, input: os.path.dirname(input.figures[0]),
        shown=REPORT_SHOWN,
    script:
        "../scripts/render_report.py"
