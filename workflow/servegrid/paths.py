"""Where every artefact lives, relative to the working directory (the repository root).

The Snakefile and the CLI both take paths from here, so a file's name is
decided once.
"""

from __future__ import annotations

RESULTS = "results"
STATE_DIR = f"{RESULTS}/.servegrid"  # runtime state of live servers: not a DAG artefact

CELL_PATTERN = RESULTS + "/cells/{configuration}/{mode}/ctx{context}_c{concurrency}.parquet"
SERVER_SPEC_PATTERN = RESULTS + "/servers/{configuration}/spec.json"
SERVER_STOP_PATTERN = RESULTS + "/servers/{configuration}/stopped.json"
SERVER_LOG_DIR_PATTERN = RESULTS + "/servers/{configuration}/logs"

REQUESTS_TABLE = f"{RESULTS}/tables/requests.parquet"
SUMMARY_TABLE = f"{RESULTS}/tables/summary.parquet"
SERVERS_TABLE = f"{RESULTS}/tables/servers.parquet"
COMPARISONS_TABLE = f"{RESULTS}/tables/comparisons.parquet"
VERDICT_TABLE = f"{RESULTS}/tables/verdict.parquet"
CROSSOVERS_TABLE = f"{RESULTS}/tables/crossovers.parquet"
PRODUCTION_TABLE = f"{RESULTS}/tables/production.parquet"
GATEWAY_TABLE = f"{RESULTS}/tables/gateway.parquet"  # the gateway's added latency (route: both)
GATEWAY_VERDICT_TABLE = f"{RESULTS}/tables/gateway_verdict.parquet"  # the verdict through it, beside the direct one
SUMMARY_CSV = f"{RESULTS}/tables/summary.csv"
REQUESTS_CSV = f"{RESULTS}/tables/requests.csv"
BENCH_EXPORT_DIR = (
    f"{RESULTS}/exports/vllm-bench"  # one vllm bench serve result per cell (servegrid.reporting.interchange)
)
FIGURES_DIR = f"{RESULTS}/figures"
FIGURES_LANG_DIR = FIGURES_DIR + "/{lang}"
REPORT_DIR = f"{RESULTS}/report"
REPORT_PATTERN = REPORT_DIR + "/servegrid-{lang}.{ext}"


def cell(configuration: str, mode: str, context: int, concurrency: int) -> str:
    return CELL_PATTERN.format(configuration=configuration, mode=mode, context=context, concurrency=concurrency)


def server_stop(configuration: str) -> str:
    return SERVER_STOP_PATTERN.format(configuration=configuration)


def server_log_dir(configuration: str) -> str:
    return SERVER_LOG_DIR_PATTERN.format(configuration=configuration)
