"""What sequential sampling costs on the GPU host: an estimate, printed with its assumptions.

Samples per cell come from the CPU demo's measured dispersion (its requests table, after `make demo`): per
mode and for one session vs several, the robust spread of the log of each cell's primary samples (IQR /
1.349), then simulated cells drawn lognormal with that spread, sampled by config.yaml's rule with the
runner's own schedule (servegrid.stats.sampling.next_stage_rounds + decide). GPU time per sample comes from the
seed's published latencies (tests/data/seed-findings.yaml), with these simplifications, all of which make the
figure a lower bound at high concurrency: per-session decode speed as at one session; TTFT interpolated
linearly in concurrency between the seed's points for a context (the nearest point where it has one only);
a round lasts one request (one conversation) of the slower configuration's figures where the seed gives one;
a cell ends at max_duration_s plus the round in flight. The demo's spread at several sessions comes from four
sessions queueing on one CPU core, likely wider than a GPU's continuous batching (a guess), so the estimate
is high there.

    .venv/bin/python benchmarks/sampling_cost.py [--results results] [--config config.yaml]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from servegrid import modes
from servegrid.config import Experiment
from servegrid.stats import sampling

ROOT = Path(__file__).resolve().parent.parent
TRIALS = 400


def demo_spread(requests: pd.DataFrame) -> dict[tuple[str, bool], float]:
    """Median over cells of the robust sigma of log(primary), per (mode, several sessions)."""
    spreads: dict[tuple[str, bool], list[float]] = {}
    for (mode, _conf, _ctx, concurrency), cell in requests.groupby(["mode", "configuration", "context", "concurrency"]):
        primary = modes.get(mode).primary
        values = primary.rows(cell)[primary.column].dropna().to_numpy(dtype=float)
        if values.size < 8:
            continue
        q1, q3 = np.percentile(np.log(values), [25, 75])
        spreads.setdefault((mode, concurrency > 1), []).append((q3 - q1) / 1.349)
    return {key: float(np.median(v)) for key, v in spreads.items()}


def samples_needed(sigma: float, rule: sampling.SamplingRule, concurrency: int, seed: int) -> tuple[float, float]:
    """Median samples at the stop and the share of cells that stop precise, for lognormal(sigma) samples."""
    rng = np.random.default_rng(seed)
    stops, precise = [], 0
    for _ in range(TRIALS):
        values = np.exp(sigma * rng.standard_normal(rule.max_samples + concurrency))
        n = 0
        while rounds := sampling.next_stage_rounds(rule, n, concurrency):
            n += rounds * concurrency
            decision = sampling.decide(values[:n], 0.0, rule)
            if decision.stop:
                precise += decision.precise
                break
        stops.append(n)
    return float(np.median(stops)), precise / TRIALS


def seconds_per_round(mode: str, context: int, concurrency: int, seed: dict) -> float:
    """One request (one conversation in multi-turn) of a session, from the seed's figures (module docstring)."""
    decode_tps = min(seed["decode"]["points"][0]["prefix_cache"], seed["decode"]["points"][0]["mtp"])
    if mode == "decode":
        return 512 / decode_tps
    if mode == "single_turn":
        points = [p for p in seed["single_turn_shared_prefix"]["points"] if p["prefix"] == context] or [
            min(seed["single_turn_shared_prefix"]["points"], key=lambda p: abs(p["prefix"] - context))
        ]
        slower = [max(p["mtp"], p["prefix_cache"]) for p in points]
        ttft = np.interp(concurrency, [p["concurrency"] for p in points], slower)
        return float(ttft) + 128 / decode_tps
    flat_high = seed["multi_turn"]["prefix_cache_flat_range"][1]
    mtp_32k_8 = next(p["mtp"] for p in seed["multi_turn"]["points"] if p["context"] == 32768 and p.get("mtp"))
    # MTP re-prefills the whole conversation each turn: its TTFT scales with context x sessions from 32K x 8.
    turn_ttft = max(flat_high, mtp_32k_8 * (context / 32768) * (concurrency / 8))
    return 3 * (turn_ttft + 128 / decode_tps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(ROOT / "results"))
    parser.add_argument("--config", default=str(ROOT / "config.yaml"))
    args = parser.parse_args()
    requests = pd.read_parquet(Path(args.results) / "tables" / "requests.parquet")
    spread = demo_spread(requests)
    experiment = Experiment.from_file(args.config)
    seed = yaml.safe_load((ROOT / "tests" / "data" / "seed-findings.yaml").read_text(encoding="utf-8"))
    print(f"{'mode':12} {'sessions':>8} {'sigma':>6} {'samples':>8} {'precise':>8} {'cells':>5} {'GPU h':>7}")
    total_h = 0.0
    for mode, workload in experiment.workloads.items():
        rule = experiment.sampling_rules[mode]
        if rule is None:
            print(f"{mode:12} fixed count: nothing to estimate")
            continue
        for concurrency in workload.concurrency:
            sigma = spread.get((mode, concurrency > 1))
            if sigma is None:
                continue
            n, precise = samples_needed(sigma, rule, concurrency, seed=concurrency)
            rounds = math.ceil(n / concurrency)
            # A cell stops at max_duration_s, after the requests in flight (at most one round more).
            per_cell = [rounds * seconds_per_round(mode, c, concurrency, seed) for c in workload.contexts]
            capped = [
                min(t, rule.max_duration_s + seconds_per_round(mode, c, concurrency, seed))
                for t, c in zip(per_cell, workload.contexts, strict=True)
            ]
            hours = sum(capped) / 3600
            hours *= len(experiment.configurations)
            total_h += hours
            cells = len(workload.contexts) * len(experiment.configurations)
            row = f"{mode:12} {concurrency:>8} {sigma:>6.3f} {n:>8.0f} {precise:>8.0%} {cells:>5} {hours:>7.2f}"
            print(row)
    print(f"total: about {total_h:.1f} GPU hours of measuring (warm-ups and server starts not counted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
