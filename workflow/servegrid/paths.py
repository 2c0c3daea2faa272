"""Where every artefact lives, relative to the working directory (the repository root).

The Snakefile and the CLI both take paths from here, so a file's name is
decided once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

RESULTS = "results"
STATE_DIR = f"{RESULTS}/.servegrid"  # runtime state of live servers: not a DAG artefact
PLANS_DIR = f"{RESULTS}/.plans"  # the config each run planned with, read by its queued jobs (config.plan)

# {load}: c<sessions> (closed loop) or r<requests/s> (open loop): servegrid.config.grid
CELL_PATTERN = RESULTS + "/cells/{configuration}/{mode}/ctx{context}_{load}.parquet"
CELL_LOG_PATTERN = RESULTS + "/logs/cells/{configuration}/{mode}/ctx{context}_{load}.log"
# Sampling that serves the verdict (servegrid.analysis.top_ups): what each round decided, and its top-ups, each the
# measured phase of one cell again (a file of the cell format, beside its cell: a cell's file is never rewritten).
DECISION_PATTERN = RESULTS + "/decisions/round{round}.json"
TOP_UP_PATTERN = RESULTS + "/top-ups/round{round}/{configuration}/{mode}/ctx{context}_{load}.parquet"
TOP_UP_LOG_PATTERN = RESULTS + "/logs/top-ups/round{round}/{configuration}/{mode}/ctx{context}_{load}.log"
SERVER_SPEC_PATTERN = RESULTS + "/servers/{configuration}/spec.json"
PREFLIGHT_PATTERN = RESULTS + "/servers/{configuration}/preflight.json"  # written with the spec
SERVER_STOP_PATTERN = RESULTS + "/servers/{configuration}/stopped.json"
SERVER_LOG_DIR_PATTERN = RESULTS + "/servers/{configuration}/logs"
# What one short session of the server measured about its cells' cost (servegrid.pipeline.calibration_pass): kept with
# the spec, redone only when the spec changes.
CALIBRATION_PATTERN = RESULTS + "/servers/{configuration}/calibration.json"
CALIBRATION_LOG_PATTERN = RESULTS + "/logs/servers/{configuration}/calibration.log"

REQUESTS_TABLE = f"{RESULTS}/tables/requests.parquet"
SUMMARY_TABLE = f"{RESULTS}/tables/summary.parquet"
SERVERS_TABLE = f"{RESULTS}/tables/servers.parquet"
COMPARISONS_TABLE = f"{RESULTS}/tables/comparisons.parquet"
VERDICT_TABLE = f"{RESULTS}/tables/verdict.parquet"
CROSSOVERS_TABLE = f"{RESULTS}/tables/crossovers.parquet"
PRODUCTION_TABLE = f"{RESULTS}/tables/production.parquet"
GATEWAY_TABLE = f"{RESULTS}/tables/gateway.parquet"  # the gateway's added latency (route: both)
GATEWAY_VERDICT_TABLE = f"{RESULTS}/tables/gateway_verdict.parquet"  # the verdict through it, beside the direct one
RATES_TABLE = f"{RESULTS}/tables/rates.parquet"  # open loop: each configuration's sustainable rate
SUMMARY_CSV = f"{RESULTS}/tables/summary.csv"
REQUESTS_CSV = f"{RESULTS}/tables/requests.csv"
BENCH_EXPORT_DIR = (
    f"{RESULTS}/exports/vllm-bench"  # one vllm bench serve result per cell (servegrid.reporting.interchange)
)
FIGURES_DIR = f"{RESULTS}/figures"
FIGURES_LANG_DIR = FIGURES_DIR + "/{lang}"
REPORT_DIR = f"{RESULTS}/report"
REPORT_PATTERN = REPORT_DIR + "/servegrid-{lang}.{ext}"


def calibration_path(configuration: str) -> str:
    return CALIBRATION_PATTERN.format(configuration=configuration)


def cell(configuration: str, mode: str, context: int, load: str) -> str:
    return CELL_PATTERN.format(configuration=configuration, mode=mode, context=context, load=load)


def top_up(configuration: str, mode: str, context: int, load: str, round_: int) -> str:
    return TOP_UP_PATTERN.format(configuration=configuration, mode=mode, context=context, load=load, round=round_)


def decision(round_: int) -> str:
    return DECISION_PATTERN.format(round=round_)


def server_stop(configuration: str) -> str:
    return SERVER_STOP_PATTERN.format(configuration=configuration)


def server_log_dir(configuration: str) -> str:
    return SERVER_LOG_DIR_PATTERN.format(configuration=configuration)


class Named(Protocol):
    """Named files: a Snakemake job's ``input`` or ``output``, or a dict."""

    def items(self) -> Iterable[tuple[str, Any]]: ...


@dataclass(frozen=True)
class RunTables:
    """The Parquet tables of a run, one path each: aggregation writes every one, the figures, the report and the
    exports read theirs. The Snakemake jobs and the CLI take this one object, so a stage run by hand reads and
    writes exactly the files its rule declares."""

    requests: str = REQUESTS_TABLE
    summary: str = SUMMARY_TABLE
    servers: str = SERVERS_TABLE
    comparisons: str = COMPARISONS_TABLE
    verdict: str = VERDICT_TABLE
    crossovers: str = CROSSOVERS_TABLE
    production: str = PRODUCTION_TABLE
    gateway: str = GATEWAY_TABLE
    gateway_verdict: str = GATEWAY_VERDICT_TABLE
    rates: str = RATES_TABLE

    @classmethod
    def under(cls, folder: str | Path) -> RunTables:
        """Every table under its usual file name in ``folder`` (tests, and runs kept apart)."""
        return cls(**{name: str(Path(folder) / Path(path).name) for name, path in asdict(cls()).items()})

    @classmethod
    def from_named(cls, named: Named) -> RunTables:
        """The tables a Snakemake job names in its input or output (other names ignored); the rest where they
        usually are."""
        given = dict(named.items())
        return cls(**{f.name: str(given[f.name]) for f in fields(cls) if f.name in given})

    def named(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """``{name: path}`` of ``names`` (every table by default): a rule's named input or output."""
        every = asdict(self)
        return {name: every[name] for name in (every if names is None else names)}
