"""servegrid: measure LLM-serving configurations cell by cell, then report a verdict.

    config.yaml ─► tiny_model? ─► server_spec (+ preflight) ─► cell × grid ─► server_stop
                                                                   │                │
                         sampling.policy verdict: decide_round ⇄ top_up (rounds)    │
                                                                   ▼                ▼
                                      aggregate (Parquet) ─► figures ─► report_html, report_pdf (pt, hu)
                                                │
                                                └─► export (CSV, vllm bench serve JSON)

    target calibrate: server_spec ─► calibration (one short session per configuration;
                      servegrid estimate prices the run from it)

`snakemake --cores 1 report` runs what is stale; `snakemake -n report` shows
what would run and why.
"""

from snakemake.utils import min_version

min_version("9.17")


# --configfile replaces config.yaml instead of being merged into it, so a demo
# config never inherits the GPU host's configurations.
if not workflow.config_settings.configfiles:

    configfile: "config.yaml"


# On a cluster (profiles/slurm) only a configuration's server and cells need its node: the rest runs where
# Snakemake runs, without a queue wait.
localrules:
    decide_round,
    aggregate,
    export,
    figures,
    report_html,
    report_pdf,
    report,
    calibrate,


include: "workflow/rules/common.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/servers.smk"
include: "workflow/rules/cells.smk"
include: "workflow/rules/top_ups.smk"
include: "workflow/rules/calibration.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/export.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/report.smk"


# The target names every cell too: Snakemake does not rebuild a deleted
# intermediate file while everything downstream of it is up to date, but it
# does rebuild a missing input of the target, and then everything after it.
rule report:
    default_target: True
    input:
        expand(paths.REPORT_PATTERN, lang=LANGUAGES, ext=EXPERIMENT.report_formats),
        paths.BENCH_EXPORT_DIR,
        paths.SUMMARY_CSV,
        paths.REQUESTS_CSV,
        all_cells(),


onstart:
    write_plan()  # what queued jobs measure, whatever the config files say by then


onsuccess:
    stop_all_servers("pipeline finished")
    print_run_summary()


onerror:
    stop_all_servers("pipeline failed or was interrupted")
    print_unfinished()
