"""decode: cold prompts of exactly ``context`` tokens, exactly ``output_tokens`` out.

Primary figure: decode tokens/s per session, (output tokens − 1) / (e2e − TTFT).
Nothing is shared between requests, so no prefix-cache hit is expected.
"""

from __future__ import annotations

from servegrid.modes.base import N_, FigureSpec, Mode, Primary
from servegrid.modes.registry import register
from servegrid.modes.runner import MeasureHook, WorkloadContext, measure_completions, send_one_by_one


async def run(ctx: WorkloadContext, measure: MeasureHook) -> None:
    warmups = [ctx.builder.unique(ctx.context, f"warmup {i}") for i in range(ctx.workload["warmup_requests"])]
    await send_one_by_one(ctx, "warmup", warmups)
    await measure_completions(
        ctx, measure, lambda units: [ctx.builder.unique(ctx.context, f"s{s} r{r}") for s, r in units]
    )


MODE = register(
    Mode(
        name="decode",
        run=run,
        primary=Primary(
            "decode_tps",
            higher_is_better=True,
            unit="rate",
            axis_label=N_("decode tokens/s per session (p50)"),
            header=N_("tok/s per session"),
            verdict_word=N_("decode"),
        ),
        title=N_("Decode"),
        short_title=N_("Decode, cold prompts"),
        class_title=N_("Decode-heavy work, long generations, cold prompts"),
        section_title=N_("Decode: cold prompts, long generations"),
        description=N_(
            "Prompts of %(prompt)s tokens that share nothing with any earlier request, exactly %(output)s "
            "output tokens each. The figure is the decode speed one session sees: (output tokens − 1) / (end − first "
            "token)."
        ),
        context_title=N_("prompt of %(tokens)s tokens"),
        context_header=N_("Prompt"),
        open_loop=True,
        schema={},
        defaults={"output_tokens": 512, "requests_per_session": 3},
        figures=(
            FigureSpec(
                "decode_tps",
                "primary_by_concurrency",
                N_("Decode tokens/s per session vs concurrent sessions"),
                N_("Decode tokens/s per session (p50, 95%% CI) vs concurrent sessions, one line per configuration."),
            ),
            FigureSpec(
                "decode_pareto",
                "throughput_latency",
                N_("Throughput against the speed each session sees"),
                N_(
                    "Total output tokens/s of the server against decode tokens/s per session (p50), one curve per "
                    "configuration and prompt length, each point labelled with its concurrent sessions: up and to "
                    "the right is better; a curve that bends down trades per-session speed for throughput."
                ),
            ),
        ),
        describe=lambda w: {"prompt": list(w["contexts"]), "output": w["output_tokens"]},
        conclusion=N_("%(winner)s pays off for decode-heavy work on cold prompts (%(range)s)."),
    )
)
