"""The calibration server's two wire dialects: vLLM's, and one of its own.

The vLLM dialect imitates what servegrid reads from vLLM (its metric names,
across the rename of vLLM 0.11). The calibration dialect shares nothing on
the wire with it: other endpoints, another request field for the output
length, other metric names and labels, its own start-up log line, launch flags
and API key variable. Its names are defined here once, for the server that
speaks it (:mod:`servegrid.testing.calibration`) and for the engine that reads
it (:class:`servegrid.testing.engine.CalibrationEngine`).

The server keeps its figures under servegrid's canonical metric names
(:data:`servegrid.engines.metrics.COUNTERS`, :data:`servegrid.engines.metrics.GAUGES`); each
dialect renders them its own way.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

VLLM, CALIBRATION = "vllm", "calibration"
DIALECTS = (VLLM, CALIBRATION)

# The server's pretend capacity: 64 sequences of 4096 tokens in 16-token blocks.
KV_BLOCK_TOKENS = 16
KV_POOL_SEQUENCES = 64
KV_POOL_TOKENS = KV_POOL_SEQUENCES * 4096
CONTEXT_LIMIT = 1_000_000
BUILD = "calibration-1"

# ---- the calibration dialect ------------------------------------------------------
PATHS = {
    "health": "/ready",
    "info": "/calibration/info",
    "metrics": "/calibration/metrics",
    "tokenize": "/calibration/tokens",
    "detokenize": "/calibration/text",
    "reset_cache": "/calibration/reset-cache",
    "completions": "/calibration/v1/completions",
    "chat": "/calibration/v1/chat/completions",
}
OUTPUT_TOKENS_FIELD = "exact_tokens"  # the one length a request sets: the stream has exactly this many tokens
API_KEY_VAR = "CALIBRATION_API_TOKEN"
MODEL_LABEL = "served"
# servegrid's canonical metric name → the calibration dialect's (counters get "_total" in the exposition).
METRIC_NAMES = {
    "prefix_cache_queries": "calibration_cache_lookup_tokens",
    "prefix_cache_hits": "calibration_cache_hit_tokens",
    "prompt_tokens": "calibration_input_tokens",
    "generation_tokens": "calibration_output_tokens",
    "spec_decode_num_drafts": "calibration_verify_steps",
    "spec_decode_num_draft_tokens": "calibration_draft_tokens",
    "spec_decode_num_accepted_tokens": "calibration_accepted_draft_tokens",
    "num_requests_running": "calibration_active_requests",
    "num_requests_waiting": "calibration_queued_requests",
    "kv_cache_usage_perc": "calibration_kv_pool_used_ratio",
    "time_to_first_token_seconds": "calibration_first_token_latency_seconds",
    "request_time_per_output_token_seconds": "calibration_token_interval_seconds",
}
STARTUP_RE = re.compile(r"calibration server: KV pool of (\d+) tokens in \d+-token blocks, room for (\d+) sequences")


def startup_line() -> str:
    """What the server logs at start about its KV pool (:data:`STARTUP_RE` reads it back)."""
    return (
        f"calibration server: KV pool of {KV_POOL_TOKENS} tokens in {KV_BLOCK_TOKENS}-token blocks, "
        f"room for {KV_POOL_SEQUENCES} sequences"
    )


def info() -> dict[str, object]:
    """What the server says about itself at ``PATHS["info"]``."""
    return {"build": BUILD, "context_limit": CONTEXT_LIMIT, "kv_block_tokens": KV_BLOCK_TOKENS}


Figures = Mapping[str, float]


def _exposition(
    name_of: Callable[[str], str],
    label_key: str,
    model: str,
    counters: Figures,
    gauges: Figures,
    histograms: Mapping[str, Sequence[float]],
    counter_suffix: str,
) -> str:
    label = f'{{{label_key}="{model}"}}'
    lines = []
    for canonical, value in counters.items():
        name = name_of(canonical)
        lines += [f"# TYPE {name} counter", f"{name}{counter_suffix}{label} {value}"]
    for canonical, value in gauges.items():
        name = name_of(canonical)
        lines += [f"# TYPE {name} gauge", f"{name}{label} {value}"]
    for canonical, values in histograms.items():
        name = name_of(canonical)
        lines += [
            f"# TYPE {name} histogram",
            f'{name}_bucket{{le="+Inf",{label_key}="{model}"}} {len(values)}',
            f"{name}_count{label} {len(values)}",
            f"{name}_sum{label} {sum(values)}",
        ]
    return "\n".join(lines) + "\n"


def calibration_exposition(
    model: str, counters: Figures, gauges: Figures, histograms: Mapping[str, Sequence[float]]
) -> str:
    return _exposition(METRIC_NAMES.__getitem__, MODEL_LABEL, model, counters, gauges, histograms, "_total")


def vllm_exposition(
    model: str, counters: Figures, gauges: Figures, histograms: Mapping[str, Sequence[float]], legacy: bool
) -> str:
    """vLLM's names: ``vllm:<canonical>``, counters with ``_total``; ``legacy``: before vLLM 0.11."""
    legacy_names = {
        "prefix_cache_queries": "vllm:gpu_prefix_cache_queries",
        "prefix_cache_hits": "vllm:gpu_prefix_cache_hits",
        "kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    }

    def name_of(canonical: str) -> str:
        return legacy_names.get(canonical, f"vllm:{canonical}") if legacy else f"vllm:{canonical}"

    return _exposition(name_of, "model_name", model, counters, gauges, histograms, "" if legacy else "_total")
