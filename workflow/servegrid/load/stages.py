"""A cell's measured phase in stages: how many rounds the next stage runs, and when the cell has enough.

A round is one request (one conversation in multi-turn) per session. With a sampling rule (sequential
sampling, :mod:`servegrid.stats.sampling`) the cell runs stage after stage: between two stages, when no stream
is in flight, its streams are decoded, its primary samples counted and :func:`servegrid.stats.sampling.decide`
asked whether to stop; the next stage brings it to the next of :func:`servegrid.stats.sampling.stage_targets`.
Without a rule (a fixed count) it runs one stage of ``requests_per_session`` rounds, and its samples are
judged only to say how precise it came out.

What a sample is comes from the figure the mode is judged by (:class:`Judged`: the mode's
:class:`~servegrid.modes.primary.Primary`) and the per-request formulas of :func:`servegrid.records.per_request.derive`,
so the cell counts exactly what the summary will report. The closed-loop sessions that run the stages are
:class:`servegrid.load.strategies.SessionsStrategy`'s (:mod:`servegrid.load.sessions`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import numpy as np
import pandas as pd

from servegrid import progress
from servegrid.records import cell_file, per_request
from servegrid.records.cell_settings import CellSettings
from servegrid.records.request import RequestRecord
from servegrid.stats import sampling
from servegrid.stats.sampling import Decision, SamplingRule

# Why a cell stopped: the rule's reasons, "fixed" (a fixed count, no rule) or "no_samples" (a stage added
# no valid primary sample: every request failed, so more of them would not make the cell more precise).
log = logging.getLogger(__name__)

StopReason = Literal["precise", "max_samples", "max_duration", "fixed", "no_samples"]


class Judged(Protocol):
    """The figure a cell is judged by (servegrid.modes.primary.Primary): its column, and the requests it counts."""

    @property
    def column(self) -> str:
        """The per-request column of its samples."""
        ...

    def rows(self, requests: pd.DataFrame) -> pd.DataFrame:
        """The requests its samples come from (measured, valid, of its turn)."""
        ...


def samples_so_far(request_records: list[RequestRecord], primary: Judged) -> np.ndarray:
    """The primary figure of every valid measured request so far (of the primary turn only, where it has one)."""
    if not request_records:
        return np.empty(0)
    frame = per_request.derive(pd.DataFrame(cell_file.rows(request_records)))
    values: np.ndarray = primary.rows(frame)[primary.column].to_numpy(dtype=float)
    present: np.ndarray = values[~np.isnan(values)]
    return present


@dataclass
class StagePlan:
    """The stages of one cell's measured phase (see the module docstring)."""

    concurrency: int
    primary: Judged
    rule: SamplingRule | None
    fixed_rounds: int = 0  # requests_per_session, where there is no rule
    fixed_limit_s: float | None = None  # workloads.<mode>.duration_s, where there is no rule
    stages: list[dict[str, Any]] = field(default_factory=list)
    decision: Decision | None = None
    reason: StopReason | None = None
    label: str = ""  # the cell's id, for its progress lines

    @classmethod
    def from_settings(cls, settings: dict[str, Any], primary: Judged) -> StagePlan:
        """A cell's plan from its settings (Experiment.cell_settings): its rule, else its fixed count and limit."""
        typed = CellSettings(settings)
        rule_fields, workload = typed.rule, typed.workload
        return cls(
            label=typed.cell_id,
            concurrency=typed.sessions or 0,  # an open-loop cell has no sessions (its plan is a fixed count)
            primary=primary,
            rule=SamplingRule(**rule_fields) if rule_fields else None,
            fixed_rounds=workload.get("requests_per_session", 0),
            fixed_limit_s=workload.get("duration_s"),
        )

    @property
    def time_limit_s(self) -> float | None:
        """Seconds after the start of measuring at which a session starts nothing new."""
        return self.rule.max_duration_s if self.rule is not None else self.fixed_limit_s

    def next_rounds(self, request_records: list[RequestRecord], elapsed_s: float) -> int:
        """Rounds of the next stage, from the requests so far and the seconds since measuring began; 0: stop.

        Call it once before the first stage and once after each; it records each stage it plans.
        """
        if not self.stages:
            rounds = (
                self.fixed_rounds if self.rule is None else sampling.next_stage_rounds(self.rule, 0, self.concurrency)
            )
            n = 0
        else:
            values = samples_so_far(request_records, self.primary)
            n = int(values.size)
            self.stages[-1]["n_after"] = n
            rounds = self._after_stage(values, elapsed_s)
            log.info("%s", self._stage_line(n, elapsed_s, rounds))
        if rounds:
            self.stages.append({"rounds": rounds, "n_before": n})
        return rounds

    def _stage_line(self, n: int, elapsed_s: float, rounds: int) -> str:
        """A stage's end, as the cell's progress line: its samples, its precision, what comes next."""
        line = f"cell {self.label}: stage {len(self.stages)} done, {n} samples in {progress.duration(elapsed_s)}"
        width = None if self.decision is None else self.decision.rel_half_width
        if self.rule is not None:
            shown = "n too small" if width is None else f"±{width:.1%}"
            line += f", median {shown} (target ±{self.rule.target_rel_ci:.0%})"
            if self.rule.max_duration_s != float("inf"):
                line += f", at most {progress.duration(self.rule.max_duration_s)}"
        if rounds:
            return f"{line}; next stage: {rounds} round(s) of {self.concurrency} session(s)"
        return f"{line}; stops: {self.reason}"

    def _after_stage(self, values: np.ndarray, elapsed_s: float) -> int:
        if self.rule is None:
            self.reason = "fixed"
            return 0
        self.decision = sampling.decide(values, elapsed_s, self.rule)
        if self.decision.stop:
            self.reason = self.decision.reason
            return 0
        if values.size == self.stages[-1]["n_before"]:
            self.reason = "no_samples"
            return 0
        return sampling.next_stage_rounds(self.rule, int(values.size), self.concurrency)

    def time_up(self) -> None:
        """The time limit passed while the cell was judged: the stage just planned is dropped, unrun."""
        self.stages.pop()
        self.reason = "max_duration"

    def stage_started(self, elapsed_s: float) -> None:
        """The planned stage starts ``elapsed_s`` after measuring began (its prompts built)."""
        self.stages[-1]["start_s"] = elapsed_s

    def stage_ended(self, elapsed_s: float) -> None:
        """The stage just run ended ``elapsed_s`` after measuring began (its requests all done)."""
        self.stages[-1]["end_s"] = elapsed_s

    @property
    def active_s(self) -> float:
        """Seconds the stages ran, without the pauses between them (prompts built for the next stage)."""
        active: float = sum(s["end_s"] - s["start_s"] for s in self.stages if "end_s" in s and "start_s" in s)
        return active

    def summary(self) -> dict[str, Any]:
        """What the cell file keeps of its sampling: the rule, why it stopped, its stages."""
        rule = self.rule
        return {
            "rule": None if rule is None else asdict(rule),
            "reason": self.reason,
            "stop_rel_half_width": None if self.decision is None else self.decision.rel_half_width,
            "stages": self.stages,
        }
