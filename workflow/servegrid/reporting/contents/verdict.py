"""The report's verdict section: who wins each class, by how much, and where the lead changes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from servegrid import modes
from servegrid.modes.base import N_
from servegrid.reporting.contents.shared import Contents
from servegrid.stats import intervals


class VerdictContents(Contents):
    def verdict_classes(self) -> list[dict[str, Any]]:
        """The verdict table: classes that have data, each with its winner's label; a KV-limit class also
        with the capacity it ran into (as the seed explains its third row)."""
        return [
            row
            | {"winner_label": self.labels(row["winner"])}
            | (self.kv_capacity() if row["outcome"] == "kv_limit" else {})
            for row in self.records(self.verdict)
            if row["outcome"] != "no_data"
        ]

    def kv_capacity(self) -> dict[str, Any]:
        """Over the KV-limited cells of the KV-limited cell groups (the verdict's KV corner): the smallest pool
        they had (the servers' own figure, in tokens) and the most tokens one of them could hold at once
        (sessions × its longest request, prompt and output: the live KV estimate)."""
        summary, groups = self.summary, self.comparisons
        if summary.empty or groups.empty or "kv_limited" not in summary:
            return {"kv_pool_tokens": None, "kv_asked_tokens": None}
        keys = ["mode", "context", "concurrency"]
        corner = groups.loc[groups["kv_limited"].astype(bool), keys]
        limited = summary[summary["kv_limited"].astype(bool)].merge(corner, on=keys)
        pool = pd.to_numeric(limited["kv_cache_tokens"], errors="coerce").min() if len(limited) else np.nan
        asked = pd.to_numeric(limited["peak_tokens_asked"], errors="coerce").max() if len(limited) else np.nan
        return {
            "kv_pool_tokens": None if intervals.missing(pool) else int(pool),
            "kv_asked_tokens": None if intervals.missing(asked) else int(asked),
        }

    def crossover_rows(self) -> list[dict[str, Any]]:
        """Per mode and pair: where the lead changes, with both labels."""
        return [
            row | {"leader_label": self.label(row["leader"]), "other_label": self.label(row["other"])}
            for row in self.records(self.crossovers)
        ]

    def class_title(self, class_id: str) -> str:
        mode = self.class_mode(class_id)
        return self.gettext(mode.class_title) if mode else class_id

    def verdict_word(self, class_modes: str) -> str:
        """What a class's factors measure ("decode", "TTFT"): its modes' word, when they share one."""
        words = {modes.get(m).primary.verdict_word for m in class_modes.split(",") if m}
        return self.gettext(words.pop()) if len(words) == 1 else ""

    def verdict_rows(self) -> list[dict[str, Any]]:
        return [row | {"winner_label": self.label(row["winner"])} for row in self.records(self.comparisons)]

    def sampling_stop(self, group: dict[str, Any]) -> str:
        """How a group's sampling stopped under the verdict policy, and after how many rounds of top-ups."""
        said = SAMPLING_STOPS.get(str(group.get("sampling_stop")))
        if said is None:
            return "–"
        stopped = str(self.gettext(said))
        rounds = group.get("top_up_rounds")
        if rounds is None or intervals.missing(rounds) or not int(rounds):
            return stopped
        return stopped + " · " + str(self.gettext(ROUNDS_OF_TOP_UPS)) % {"rounds": int(rounds)}


# How a group's sampling stopped (servegrid.analysis.top_ups), as the groups table says it.
SAMPLING_STOPS = {
    "decided": N_("decided"),
    "tie": N_("a tie"),
    "budget": N_("budget spent, undecided"),
    "kv_limit": N_("KV limit"),
}
ROUNDS_OF_TOP_UPS = N_("rounds of top-ups: %(rounds)s")
