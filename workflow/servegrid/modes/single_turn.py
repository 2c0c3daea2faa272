"""single_turn: one shared prefix of ``context`` tokens, a unique suffix per request.

The shared prefix is primed by the warm-up (as a shared system prompt is in
production). Before the warm-up, a probe on a second fresh prefix times a cold
first request and the second request on the same prefix (the seed's "second
request" figure). Primary figure: TTFT p50.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from servegrid.modes.base import N_, FigureSpec, Mode, PrefixCache, Primary
from servegrid.modes.registry import register
from servegrid.modes.runner import MeasureHook, WorkloadContext, measure_completions, send_one_by_one
from servegrid.records.cell_settings import CellSettings


async def run(ctx: WorkloadContext, measure: MeasureHook) -> None:
    w = ctx.workload
    suffix = w["suffix_tokens"]
    _, probe = ctx.builder.shared_prefix_prompts(ctx.context, suffix, ["probe a", "probe b"], "probe prefix")
    warmup_labels = [f"warmup {i}" for i in range(w["warmup_requests"])]
    _, warmups = ctx.builder.shared_prefix_prompts(ctx.context, suffix, warmup_labels, "shared prefix")

    def shared(units: list[tuple[int, int]]) -> list[list[int]]:
        # The same prefix at every stage: the builder derives it from its label and the cell's nonce.
        labels = [f"s{s} r{r}" for s, r in units]
        return ctx.builder.shared_prefix_prompts(ctx.context, suffix, labels, "shared prefix")[1]

    # The probe runs on an idle server: first request on a fresh prefix (turn 1), then the second (turn 2).
    await send_one_by_one(ctx, "probe", probe, turn_of_index=True)
    # Warm-up requests carry the shared prefix: it is in the cache (where caching is on)
    # before measuring, as a shared system prompt is in production.
    await send_one_by_one(ctx, "warmup", warmups)
    await measure_completions(ctx, measure, shared)


def expected_hits(settings: CellSettings, measured: pd.DataFrame, cache: PrefixCache) -> float:
    """The shared prefix in the whole blocks the server reuses (PrefixCache), over prefix + suffix; where the
    warm-up carried the prefix fewer times than the cache needs (``cache.sightings``), the first rounds of
    measured requests (one request per session, sent together) miss it."""
    prefix = settings.context
    per_request = cache.hit_tokens(prefix) / (prefix + settings.workload["suffix_tokens"])
    rounds_missing = max(cache.sightings - settings.workload["warmup_requests"], 0)
    missing = min(len(measured), rounds_missing * (settings.sessions or 1))  # open loop: one at a time
    return per_request * (len(measured) - missing) / len(measured) if len(measured) else 0.0


def probe_columns(valid: pd.DataFrame, cell_frame: pd.DataFrame) -> dict[str, Any]:
    """TTFT of the probe's first and second request on a fresh prefix."""
    probe = cell_frame[(cell_frame["phase"] == "probe") & cell_frame["valid"]]
    first, second = probe[probe["turn"] == 1], probe[probe["turn"] == 2]
    return {
        "probe_first_ttft_s": float(first["ttft_s"].iloc[0]) if len(first) else None,
        "probe_second_ttft_s": float(second["ttft_s"].iloc[0]) if len(second) else None,
    }


MODE = register(
    Mode(
        name="single_turn",
        run=run,
        primary=Primary(
            "ttft_s",
            higher_is_better=False,
            unit="seconds",
            axis_label=N_("TTFT p50 (s)"),
            header=N_("TTFT p50"),
            verdict_word="TTFT",
        ),
        title=N_("Single-turn"),
        short_title=N_("Single-turn, shared prefix"),
        class_title=N_("Single turn, shared prefix, unique suffixes"),
        section_title=N_("Single-turn: shared prefix, unique suffixes"),
        description=N_(
            "All sessions share one prefix of the given length (in the cache beforehand where caching is on, as a "
            "shared system prompt is); each request adds its own suffix of %(suffix)s tokens and asks for %(output)s "
            "tokens."
        ),
        context_title=N_("shared prefix of %(tokens)s tokens"),
        context_header=N_("Prefix"),
        open_loop=True,
        schema={"suffix_tokens": {"type": "integer", "minimum": 1, "default": 256}},
        defaults={"output_tokens": 128, "requests_per_session": 3},
        figures=(
            FigureSpec(
                "single_turn_ttft",
                "primary_by_concurrency",
                N_("Single-turn TTFT vs concurrent sessions"),
                N_("TTFT p50 (95%% CI) vs concurrent sessions, one panel per prefix length."),
            ),
            FigureSpec(
                "single_turn_second_request",
                "probe_bars",
                N_("First and second request on a fresh prefix"),
                N_(
                    "TTFT of the first request on a fresh prefix (solid) and of the second request on the same prefix "
                    "(hatched), one concurrent session: a cache hit where caching is on, a full re-prefill where it "
                    "is off."
                ),
            ),
        ),
        summary_columns=("probe_first_ttft_s", "probe_second_ttft_s"),
        summarize=probe_columns,
        expected_hits=expected_hits,
        corpus_extra=lambda w: w["suffix_tokens"],
        # The shared prefix (the context) can come from the cache; the suffix is new every time.
        unit_requests=lambda context, w: ((context + w["suffix_tokens"], context, w["output_tokens"]),),
        describe=lambda w: {"suffix": w["suffix_tokens"], "output": w["output_tokens"]},
        partial="modes/single_turn.html.j2",
    )
)
