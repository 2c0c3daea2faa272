"""Sampling that serves the verdict (``sampling.policy: verdict``): after every cell's first pass, rounds of
decisions, each listing the cells the next round tops up.

Round k (a Snakemake checkpoint, ``results/decisions/round<k>.json``) reads the cells and the top-ups of rounds
1..k-1, which are its declared inputs and nothing else (a round that read the folder would see later rounds' files
when it reran, and rewrite the history), pools them (servegrid.analysis.pooled_cells) and judges each cell group
(mode × context × sessions) with servegrid.stats.group_decision: ``decided``, ``tie`` or ``open``. An open group's
leader and the configurations whose pair with it is open are topped up in round k, one more run of each cell's
measured phase. The last round (``top_up_rounds`` + 1) tops nothing up: a group still open there stopped on its
``budget``. A group where a configuration ran into the KV-cache capacity is ``kv_limit`` at once (more samples do
not change "neither"), as is one with fewer than two configurations with values (``single``), which has no verdict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from servegrid import atomic, modes, paths
from servegrid.analysis import verdict
from servegrid.analysis.measured_run import measured_run
from servegrid.analysis.requests_table import closed_loop
from servegrid.config import Experiment
from servegrid.errors import CellFileError, NewerFormatError
from servegrid.stats.group_decision import MIN_VALUES, decide_group

FORMAT_VERSION = 1  # of the decision files; read_decisions reads every version written
# How a group's sampling stopped, in the comparisons table (None: the precision policy, no decision was made).
STOPPED = ("decided", "tie", "budget", "kv_limit")


@dataclass(frozen=True)
class CellFiles:
    """A round's declared inputs: the cells' files and the top-ups of the rounds before it."""

    cells: list[str]
    top_ups: list[str]


def decide_round(experiment: Experiment, round_: int, files: CellFiles, out_path: str | Path) -> dict[str, Any]:
    """Judge every closed-loop cell group from ``files`` and write round ``round_``'s decision file."""
    assert experiment.top_up_rounds is not None, "a round of decisions runs only under sampling.policy: verdict"
    last = round_ > experiment.top_up_rounds
    run = measured_run(experiment, files.cells, files.top_ups)
    closed = closed_loop(run.summary)
    values = verdict.primary_values_by_cell(closed_loop(run.derived))
    rounds_of = {m.spec.id: len(m.top_ups) for m in run.metas}
    groups, top_up = [], []
    for (mode, context, concurrency), cells in _groups(closed):
        group = _judge(experiment, round_, mode, context, concurrency, cells, values)
        group["top_ups"] = max((rounds_of.get(c["cell_id"], 0) for c in cells), default=0)
        if group["state"] == "open":
            wanted = [c for c in cells if c["configuration"] in group["open_configurations"]]
            below = [c for c in wanted if below_ceiling(experiment, c)]
            if last or not below:  # the rounds are spent, or every cell it needs is at its own ceiling
                group["state"] = "budget"
            else:
                top_up += [c["cell_id"] for c in below]
        groups.append(group)
    decision = {
        "format_version": FORMAT_VERSION,
        "round": round_,
        "last": last,
        "min_factor": experiment.verdict.min_factor,
        "groups": groups,
        "top_up": top_up,
    }
    atomic.write_json(out_path, decision)
    return decision


def below_ceiling(experiment: Experiment, cell: Mapping[str, Any]) -> bool:
    """Whether a cell (its pooled summary row) is below its own ceiling, its rule's max_samples and max_duration_s as
    written: a top-up never takes a cell past what the precision policy would have sampled. Except a cell its time
    limit stopped before it had a median (MIN_VALUES): the precision policy would leave it without one, and its group
    without a verdict; it is topped up (within the rounds) until it has one."""
    most_samples, most_seconds = experiment.top_up_ceilings.get(str(cell["mode"]), (math.inf, math.inf))
    samples, seconds = (float(cell[key]) if pd.notna(cell[key]) else 0.0 for key in ("primary_n", "duration_s"))
    return samples < most_samples and (seconds < most_seconds or samples < MIN_VALUES)


def _groups(closed: pd.DataFrame) -> list[tuple[tuple[str, int, int], list[dict[str, Any]]]]:
    """Each closed-loop group's valid cells; one with too few values for a median is judged too (its pair stays
    open, stats.group_decision.MIN_VALUES), so that a top-up completes it."""
    if closed.empty:
        return []
    usable = closed[closed["valid"].astype(bool)]
    columns = ["cell_id", "configuration", "mode", "context", "concurrency", "kv_limited", "primary_n", "duration_s"]
    out: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for record in usable[columns].to_dict("records"):
        out.setdefault((record["mode"], int(record["context"]), int(record["concurrency"])), []).append(record)
    return list(out.items())


def _judge(
    experiment: Experiment,
    round_: int,
    mode: str,
    context: int,
    concurrency: int,
    cells: list[dict[str, Any]],
    values: Mapping[tuple[str, str, int, int], Any],
) -> dict[str, Any]:
    group: dict[str, Any] = {"mode": mode, "context": context, "concurrency": concurrency}
    if any(bool(c["kv_limited"]) for c in cells):
        return group | {"state": "kv_limit", "leader": None, "pairs": [], "open_configurations": []}
    decision = decide_group(
        {c["configuration"]: values.get((c["configuration"], mode, context, concurrency), []) for c in cells},
        bool(modes.get(mode).primary.higher_is_better),
        experiment.verdict.min_factor,
        seed=f"round{round_}/{mode}/{context}/{concurrency}",
    )
    if decision is None:
        return group | {"state": "single", "leader": None, "pairs": [], "open_configurations": []}
    return group | {
        "state": decision.state,
        "leader": decision.leader,
        "pairs": [
            {"other": p.other, "factor": p.factor, "low": p.low, "high": p.high, "state": p.state}
            for p in decision.pairs
        ],
        "open_configurations": decision.open_configurations,
    }


def read_decisions(path: str | Path) -> dict[str, Any]:
    """A decision file of any format written (there is one: 1); a newer one is refused by name."""
    try:
        decision: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CellFileError(f"{path}: cannot read the round's decisions ({exc}); delete it to decide again") from exc
    version = int(decision.get("format_version", 0))
    if version > FORMAT_VERSION:
        raise NewerFormatError(f"{path}: decisions of format {version}, written by a newer servegrid")
    return decision


def top_ups_listed(path: str | Path) -> list[str]:
    """The ids of the cells a round's decision file tops up."""
    return [str(cell) for cell in read_decisions(path).get("top_up", [])]


def with_how_sampling_stopped(comparisons: pd.DataFrame, decision: Mapping[str, Any]) -> pd.DataFrame:
    """The comparisons table with, per group, how its sampling stopped (``sampling_stop``: decided, tie, budget,
    kv_limit) and after how many rounds of top-ups (``top_up_rounds``)."""
    if comparisons.empty:
        return comparisons
    stopped = {(g["mode"], int(g["context"]), int(g["concurrency"])): g for g in decision.get("groups", [])}
    contexts, loads = comparisons["context"].astype(int), comparisons["concurrency"].astype(int)
    keys = list(zip(comparisons["mode"], contexts, loads, strict=True))
    return comparisons.assign(
        sampling_stop=[_stop(stopped.get(k)) for k in keys],
        top_up_rounds=[int(stopped[k]["top_ups"]) if k in stopped else None for k in keys],
    )


def _stop(group: Mapping[str, Any] | None) -> str | None:
    state = None if group is None else str(group["state"])
    return state if state in STOPPED else None


def cells_of_round(ids: Sequence[str], known: Mapping[str, Any]) -> list[Any]:
    """The cells of the grid among ``ids`` (a decision file written for an earlier grid may name others)."""
    return [known[i] for i in ids if i in known]


def top_ups_decided(experiment: Experiment, before_round: int) -> list[str]:
    """The top-up files that the decisions of rounds 1..before_round-1 ask for (by hand, as the pipeline's input
    functions do it): :class:`CellFileError` naming a round not decided yet."""
    grid = {cell.id: cell for cell in experiment.cells()}
    files: list[str] = []
    for earlier in range(1, before_round):
        decided = paths.decision(earlier)
        if not Path(decided).exists():
            raise CellFileError(f"{decided}: round {earlier} is not decided yet (servegrid decide {earlier})")
        files += [cell.top_up_path(earlier) for cell in cells_of_round(top_ups_listed(decided), grid)]
    return files
