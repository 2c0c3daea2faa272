"""A seeded, realistic trace for the demo and the tests, made offline (Mooncake records).

Bursty arrivals (gamma gaps of shape ``burstiness`` < 1, as servegrid.load.arrivals draws them), long-tailed
prompt and output lengths (log-normal, clipped), a few shared system prompts (whole blocks that many requests
start with, as a product's system prompt is) and multi-turn sessions, whose later turns start with the previous
turn's whole prompt blocks and arrive a think time after the previous answer (``delay``). Same settings, same
trace, byte for byte: ``servegrid trace generate`` writes it for a reader or another tool.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from servegrid.load.arrivals import Arrival, due_offsets_s


@dataclass(frozen=True)
class TraceShape:
    """The generator's settings (workloads.trace.source.generate; every one has a default)."""

    seed: int = 7
    duration_s: float = 60.0  # arrivals are due within this span at 1x
    rate: float = 2.0  # arrivals (requests or conversations) per second
    burstiness: float = 0.5  # gamma shape of the gaps: below 1, burstier than Poisson
    system_prompts: int = 3  # distinct shared system prompts
    system_prompt_blocks: int = 2  # each this many whole blocks long
    system_prompt_share: float = 0.7  # share of arrivals that start with one of them
    input_median: int = 256  # the user's part of a prompt, tokens (log-normal)
    input_sigma: float = 0.8
    output_median: int = 32
    output_sigma: float = 0.7
    max_input: int = 2048  # clip of the whole prompt (a request must fit the server's context)
    max_output: int = 256
    session_share: float = 0.25  # share of arrivals that are conversations
    max_turns: int = 3  # a conversation's turns: 2 to this many
    think_mean_s: float = 2.0  # exponential think time before a later turn

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> TraceShape:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in settings.items() if k in known})


def generate(shape: TraceShape, block_tokens: int) -> list[dict[str, Any]]:
    """The trace's records, in arrival order (a conversation's later turns right after its first)."""
    rng = np.random.default_rng(shape.seed)
    count = max(1, round(shape.duration_s * shape.rate))
    arrival = Arrival("gamma", shape.burstiness) if shape.burstiness != 1 else Arrival("poisson")
    due_ms = np.round(due_offsets_s(shape.rate, count, arrival, shape.seed) * 1000).astype(int)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    system_ids = [fresh(shape.system_prompt_blocks) for _ in range(shape.system_prompts)]

    def lognormal(median: int, sigma: float, low: int, high: int) -> int:
        return int(np.clip(round(median * float(np.exp(rng.normal(0.0, sigma)))), low, high))

    def blocks_for(tokens: int, head: list[int]) -> list[int]:
        needed = -(-tokens // block_tokens)
        return head[:needed] + fresh(max(0, needed - len(head)))

    rows: list[dict[str, Any]] = []
    for index, at_ms in enumerate(due_ms.tolist()):
        head: list[int] = []
        if shape.system_prompts and rng.random() < shape.system_prompt_share:
            head = list(system_ids[int(rng.integers(shape.system_prompts))])
        user = lognormal(shape.input_median, shape.input_sigma, 1, shape.max_input)
        tokens = min(len(head) * block_tokens + user, shape.max_input)
        output = lognormal(shape.output_median, shape.output_sigma, 1, shape.max_output)
        is_session = rng.random() < shape.session_share
        row: dict[str, Any] = {
            "timestamp": at_ms,
            "input_length": tokens,
            "output_length": output,
            "hash_ids": blocks_for(tokens, head),
        }
        if is_session:
            row["session_id"] = f"s{index}"
        rows.append(row)
        if not is_session:
            continue
        for _ in range(int(rng.integers(2, shape.max_turns + 1)) - 1):
            previous = rows[-1]
            carried = previous["hash_ids"][: previous["input_length"] // block_tokens]
            added = previous["output_length"] + lognormal(
                shape.input_median // 2, shape.input_sigma, 1, shape.max_input
            )
            tokens = min(previous["input_length"] + added, shape.max_input)
            if tokens <= previous["input_length"]:  # the conversation would no longer fit: it ends here
                break
            rows.append(
                {
                    "session_id": row["session_id"],
                    "delay": round(float(rng.exponential(shape.think_mean_s)) * 1000),
                    "input_length": tokens,
                    "output_length": lognormal(shape.output_median, shape.output_sigma, 1, shape.max_output),
                    "hash_ids": blocks_for(tokens, list(carried)),
                }
            )
    return rows
