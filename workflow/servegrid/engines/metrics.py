"""A server's own metrics, under servegrid's canonical names: scrape, diff, derive.

Each engine names its metrics its own way; :meth:`Engine.parse_metrics
<servegrid.engines.base.Engine.parse_metrics>` reduces a scrape to the
canonical names below, summed over label sets. Everything here works on those
names only.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servegrid.periodic import Periodic

if TYPE_CHECKING:
    from servegrid.engines import Engine

COUNTERS = (
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    # The server's own timing of the requests it finished (histograms: seconds summed, requests counted).
    "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count",
    "request_time_per_output_token_seconds_sum",
    "request_time_per_output_token_seconds_count",
)
GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "num_requests_waiting_capacity")


def canonical_values(exposition: str, canonical: Callable[[str, Mapping[str, str]], str | None]) -> dict[str, float]:
    """An exposition reduced to servegrid's counters and gauges, summed over label sets.

    ``canonical(sample name, labels)`` is the engine's mapping: servegrid's name for
    that sample, or None to skip it (another model's series, a name servegrid does not read).
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            name = canonical(sample.name, sample.labels)
            if name in COUNTERS or name in GAUGES:
                values[name] = values.get(name, 0.0) + float(sample.value)
    return values


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Counter increase over a cell; None where the server does not expose the counter."""
    return {name: (after[name] - before.get(name, 0.0)) if name in after else None for name in COUNTERS}


def sum_deltas(deltas: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Counter increases over several measured phases; None where the server never exposed one."""
    out: dict[str, float | None] = {}
    for name in COUNTERS:
        values = [value for d in deltas if (value := d.get(name)) is not None]
        out[name] = sum(values) if values else None
    return out


# A latency figure → the canonical histogram in which the server times it itself.
SERVER_TIMING = {"ttft": "time_to_first_token_seconds", "tpot": "request_time_per_output_token_seconds"}


def mean_of(counter_delta: dict[str, float | None], histogram: str) -> float | None:
    """The server's mean of a histogram over the requests counted in ``counter_delta``; None without any."""
    total, count = counter_delta.get(f"{histogram}_sum"), counter_delta.get(f"{histogram}_count")
    return total / count if total is not None and count else None


def derived(counter_delta: dict[str, float | None]) -> dict[str, float | None]:
    """The server's own mean TTFT and TPOT, hit rate and speculative-decoding figures from counter deltas."""
    queries = counter_delta.get("prefix_cache_queries")
    hits = counter_delta.get("prefix_cache_hits")
    drafts = counter_delta.get("spec_decode_num_drafts")
    draft_tokens = counter_delta.get("spec_decode_num_draft_tokens")
    accepted = counter_delta.get("spec_decode_num_accepted_tokens")
    return {
        **{f"{figure}_mean_s": mean_of(counter_delta, histogram) for figure, histogram in SERVER_TIMING.items()},
        "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else None,
        "spec_acceptance_rate": (accepted / draft_tokens) if draft_tokens and accepted is not None else None,
        # Tokens per verification step: one target token plus the accepted drafts.
        "spec_mean_acceptance_length": (1 + accepted / drafts) if drafts and accepted is not None else None,
    }


async def fetch(client: httpx.AsyncClient, url: str, engine: Engine) -> str:
    """The engine's metrics page, as text."""
    response = await client.get(f"{url}{engine.metrics_path}")
    response.raise_for_status()
    return response.text


async def scrape(client: httpx.AsyncClient, url: str, engine: Engine, model_name: str | None) -> dict[str, float]:
    """Canonical metric name → value, now."""
    return engine.parse_metrics(await fetch(client, url, engine), model_name)


@dataclass
class GaugeSampler:
    """Samples the gauges every ``interval_s`` while a cell runs.

    While requests are in flight it only fetches the text: parsing an engine's
    exposition (vLLM's: about 50 kB, 12 ms in prometheus_client's parser) would
    hold the event loop and make the chunk timestamps late, so ``samples``
    parses afterwards, once per sample.
    """

    client: httpx.AsyncClient
    url: str
    engine: Engine
    model_name: str | None
    interval_s: float
    errors: int = 0
    _raw: list[tuple[float, str]] = field(default_factory=list)
    _parsed: list[dict[str, float]] = field(default_factory=list)
    _every: Periodic | None = None

    async def _sample(self) -> None:
        try:
            text = await fetch(self.client, self.url, self.engine)
            self._raw.append((time.monotonic(), text))
        except httpx.HTTPError:
            self.errors += 1

    @property
    def count(self) -> int:
        return len(self._raw)

    def samples(self, first: int = 0) -> list[dict[str, float]]:
        """The gauges of every sample from the ``first`` on, each with its time ``t``."""
        for t, text in self._raw[len(self._parsed) :]:
            values = self.engine.parse_metrics(text, self.model_name)
            self._parsed.append({"t": t, **{g: values.get(g, float("nan")) for g in GAUGES}})
        return self._parsed[first:]

    def start(self) -> None:
        self._every = self._every or Periodic(self._sample, self.interval_s)
        self._every.start()

    async def stop(self) -> None:
        if self._every:
            await self._every.stop()

    def summary(self) -> dict[str, Any]:
        samples = self.samples()
        out: dict[str, Any] = {"samples": len(samples), "scrape_errors": self.errors}
        for gauge in GAUGES:
            series = [s[gauge] for s in samples if s[gauge] == s[gauge]]
            out[f"{gauge}_max"] = max(series) if series else None
            out[f"{gauge}_mean"] = statistics.fmean(series) if series else None
        return out
