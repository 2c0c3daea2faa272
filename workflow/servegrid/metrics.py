"""vLLM's Prometheus metrics: scrape, normalise names across versions, diff.

Names changed across vLLM releases (``vllm:gpu_prefix_cache_hits`` became
``vllm:prefix_cache_hits``; ``gpu_cache_usage_perc`` became
``kv_cache_usage_perc``; counters gained ``_total`` in the exposition). Every
sample is reduced to a canonical name and summed over engines and other
labels, keeping only the served model's series when the server labels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

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

_ALIASES = {
    "gpu_prefix_cache_queries": "prefix_cache_queries",
    "gpu_prefix_cache_hits": "prefix_cache_hits",
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
    "cpu_cache_usage_perc": "kv_cache_usage_perc",
}


def canonical_name(sample_name: str) -> str:
    name = sample_name.removeprefix("vllm:")
    if name.endswith("_created"):  # creation timestamps, never values
        return ""
    name = name.removesuffix("_total")
    return _ALIASES.get(name, name)


def parse(exposition: str, model_name: str | None = None) -> dict[str, float]:
    """Canonical metric name → value, summed over label sets."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            name = canonical_name(sample.name)
            labels = sample.labels
            if name == "num_requests_waiting_by_reason":
                # vLLM >= 0.11 splits waiting requests by reason; "capacity" is the scheduler's queue.
                name = f"num_requests_waiting_{labels.get('reason', '')}"
            if name not in COUNTERS and name not in GAUGES:
                continue
            if model_name and "model_name" in labels and labels["model_name"] != model_name:
                continue
            values[name] = values.get(name, 0.0) + float(sample.value)
    return values


def cache_config(exposition: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...), or {} if absent."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.removeprefix("vllm:") == "cache_config_info":
                return dict(sample.labels)
    return {}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Counter increase over a cell; None where the server does not expose the counter."""
    return {name: (after[name] - before.get(name, 0.0)) if name in after else None for name in COUNTERS}


def sum_deltas(deltas: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Counter increases over several measured phases; None where the server never exposed one."""
    out: dict[str, float | None] = {}
    for name in COUNTERS:
        values = [d[name] for d in deltas if d.get(name) is not None]
        out[name] = sum(values) if values else None
    return out


# A latency figure → the vLLM histogram in which the server times it itself.
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


async def fetch(client: httpx.AsyncClient, url: str) -> str:
    response = await client.get(f"{url}/metrics")
    response.raise_for_status()
    return response.text


async def scrape(client: httpx.AsyncClient, url: str, model_name: str | None) -> dict[str, float]:
    return parse(await fetch(client, url), model_name)


@dataclass
class GaugeSampler:
    """Samples the gauges every ``interval_s`` while a cell runs.

    While requests are in flight it only fetches the text: parsing vLLM's
    exposition (about 50 kB, 12 ms in prometheus_client's parser) would hold
    the event loop and make the chunk timestamps late, so ``samples`` parses
    afterwards, once per sample.
    """

    client: httpx.AsyncClient
    url: str
    model_name: str | None
    interval_s: float
    errors: int = 0
    _raw: list[tuple[float, str]] = field(default_factory=list)
    _parsed: list[dict[str, float]] = field(default_factory=list)
    _task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                text = await fetch(self.client, self.url)
                self._raw.append((time.monotonic(), text))
            except httpx.HTTPError:
                self.errors += 1
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    @property
    def count(self) -> int:
        return len(self._raw)

    def samples(self, first: int = 0) -> list[dict[str, float]]:
        """The gauges of every sample from the ``first`` on, each with its time ``t``."""
        for t, text in self._raw[len(self._parsed) :]:
            values = parse(text, self.model_name)
            self._parsed.append({"t": t, **{g: values.get(g, float("nan")) for g in GAUGES}})
        return self._parsed[first:]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def summary(self) -> dict[str, Any]:
        samples = self.samples()
        out: dict[str, Any] = {"samples": len(samples), "scrape_errors": self.errors}
        for gauge in GAUGES:
            series = [s[gauge] for s in samples if s[gauge] == s[gauge]]
            out[f"{gauge}_max"] = max(series) if series else None
            out[f"{gauge}_mean"] = statistics.fmean(series) if series else None
        return out
