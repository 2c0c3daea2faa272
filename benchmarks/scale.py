"""How servegrid's stages grow with the grid: synthetic grids of about 200, 1,000 and 2,000 cells, no server.

For each size, in a temporary working directory of its own (the Snakefile, ``workflow/``, ``report/``,
``profiles/`` and ``envs/`` copied there, a config written to ``config/scale.yaml``):

1. The grid is 4 configurations (prefix caching, MTP, ngram, ngram + prefix caching) × 3 workload modes ×
   C contexts × K concurrency levels, C and K as close to equal as the size allows. Every cell file is
   written through the package's own writer (:func:`servegrid.records.cell_file.write_cell` with
   :class:`servegrid.records.request.RequestRecord`), with the metadata a real cell job records: the cell's
   settings from :meth:`Experiment.cell_settings`, its server's facts (:class:`servegrid.serving.state.ServerFacts`),
   the server's counters, derived figures (:func:`servegrid.engines.metrics.derived`) and gauges, the client's
   self-watch and the sampling stages. Rows are plausible: sequential sampling's stages (30 samples,
   sometimes a second stage), closed-loop sessions, warm-ups, probes and three-turn conversations,
   speculative configurations streaming chunks of several tokens, TTFT growing with context and load,
   about 2% of cells with a failed request and the heaviest corner past the KV-cache pool. The server
   specifications (``spec.json``, the JSON the ``server_spec`` job writes) and the stop records
   (``stopped.json``) are written too, with modification times in DAG order, so Snakemake finds every
   cell up to date and plans only the downstream jobs.
2. Each stage runs as a child process; its wall time is taken around it and its peak resident memory is
   ``ru_maxrss`` from ``os.wait4`` (the largest single process of its tree: the child or one it waited for):

   - ``dry run``: ``snakemake -n report``: the whole DAG built, every file's state checked, and the
     downstream jobs (aggregate, figures × 2, report_html × 2, report_pdf × 2) planned; the script checks that
     nothing else is planned.
   - ``aggregate``, ``figures (pt+hu)``, ``report html L``, ``report pdf L``: the pipeline's downstream
     stages, through the package's CLI (``servegrid aggregate``, ``servegrid figures``, which draws both
     languages in one process, and ``servegrid report --lang L --format F``, one document as one
     ``report_html`` or ``report_pdf`` job makes it): the functions the Snakemake jobs call, without
     Snakemake's per-job start-up.
   - ``DAG (nothing to do)``: ``snakemake -n report`` again, once the tables, figures and reports exist:
     the DAG construction and up-to-date checks alone; the script checks that it plans nothing.
   - ``setup: --touch …`` (timed, but set-up rather than a stage): Snakemake reruns a job whose output it
     has no record of in ``.snakemake/metadata`` ("Code has changed"), so ``snakemake --touch`` records the
     fake specs, cells and stops before the first dry run, and the CLI's outputs before the last one.

3. The grid's progress line (``--grid-line``, 10,000 cells unless told; ``--grid-line-only`` skips the stages):
   each cell job logs it as it starts (:mod:`servegrid.pipeline.grid_progress`). About 90% of the cells get a file
   with a cell job's footer (its server facts, metrics, gauges and sampling stages; the rows of one cell of its
   configuration and mode), 5% of them measured with other settings. Timed in one run, on the same files: the line as
   it was made up to commit 47f9ef4 (every footer read: :func:`grid_line_before`), the new line without its index
   (rebuilt from the footers, once) and with it, what its time is made of, and the cell job's update of the index.
   Both lines must say the same, or the script fails. Written to ``benchmarks/out/grid_line.json``.

It prints, per stage, seconds and peak MiB at each size, the growth factor between sizes (the time ratio
divided by the size ratio: 1.0 is linear, below 1 the fixed start-up still dominates) and the marginal
cost per cell between sizes (constant for a linear stage), flags a stage over 30 s at the largest size or
clearly worse than linear, and writes the table as JSON to ``benchmarks/out/scale.json``.

    .venv/bin/python benchmarks/scale.py                      # 200, 1000, 2000 (in fact 192, 972, 2028)
    .venv/bin/python benchmarks/scale.py --sizes 48 96 --keep # a quick look; keep the working directories
    .venv/bin/python benchmarks/scale.py --grid-line-only     # the grid line alone, at 10,000 cells (~3 min)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from servegrid import atomic, modes, paths
from servegrid.config import CellSpec, Experiment, spec_hash
from servegrid.config.sections import rule_fields
from servegrid.engines import metrics
from servegrid.engines.base import PrefixCache
from servegrid.records import cell_file, cell_format
from servegrid.records.cell_record import CellRecord
from servegrid.records.cell_settings import CellSettings
from servegrid.records.request import RequestRecord
from servegrid.serving import state

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
OUT = REPO / "benchmarks" / "out" / "scale.json"
COPIED = ("Snakefile", "workflow", "report", "profiles", "envs")
CONFIG = "config/scale.yaml"
LIMIT_S = 30.0  # the target: every stage under this at the largest size
# Growth worse than linear: a growth factor above this between two sizes, or a marginal cost per cell that
# grows by more than this between the two intervals.
SUPERLINEAR = 1.3

CONTEXTS = (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072)
CONCURRENCY = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40)
KV_POOL_TOKENS = 1_320_000  # the seed's pool: the heaviest corner of the larger grids runs past it
BLOCK = 16
MIN_SAMPLES = 30
T0_NS = 10**12  # the client's monotonic clock at the start of a cell's measured phase


@dataclass(frozen=True)
class Perf:
    """How a synthetic configuration's server behaves."""

    prefill_tps: float  # cold prefill, tokens/s
    itl_s: float  # seconds per decode step (one chunk)
    tokens_per_step: tuple[int, ...]  # tokens per chunk after the first: drawn uniformly from these
    caching: bool


CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "prefix_cache": {
        "label": {"pt": "prefix caching, sem MTP", "hu": "prefix caching, MTP nélkül"},
        "gpus": [0],
        "prefix_caching": True,
    },
    "mtp": {
        "label": {"pt": "MTP (3 tokens), sem prefix caching", "hu": "MTP (3 token), prefix caching nélkül"},
        "gpus": [1],
        "prefix_caching": False,
        "speculative": {"method": "mtp", "num_speculative_tokens": 3},
    },
    "ngram": {
        "label": {"pt": "especulação ngram (3 tokens)", "hu": "ngram spekuláció (3 token)"},
        "gpus": [2],
        "prefix_caching": False,
        "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    },
    "both": {
        "label": {"pt": "prefix caching + ngram", "hu": "prefix caching + ngram"},
        "gpus": [3],
        "prefix_caching": True,
        "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    },
}
PERF = {
    "prefix_cache": Perf(prefill_tps=14000, itl_s=0.016, tokens_per_step=(1,), caching=True),
    "mtp": Perf(prefill_tps=13000, itl_s=0.019, tokens_per_step=(1, 2, 3, 3, 4), caching=False),
    "ngram": Perf(prefill_tps=13500, itl_s=0.018, tokens_per_step=(1, 1, 2, 3), caching=False),
    "both": Perf(prefill_tps=13500, itl_s=0.018, tokens_per_step=(1, 1, 2, 3), caching=True),
}


# ---- the grid ------------------------------------------------------------------------------------------------
def grid_shape(size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Contexts and concurrency levels (each mode the same) for a grid of about ``size`` cells."""
    per_list = size / (len(CONFIGURATIONS) * 3)
    k = max(1, min(len(CONCURRENCY), round(math.sqrt(per_list))))
    c = max(1, min(len(CONTEXTS), round(per_list / k)))
    return CONTEXTS[:c], CONCURRENCY[:k]


def config_for(contexts: tuple[int, ...], concurrency: tuple[int, ...]) -> dict[str, Any]:
    grid = {"contexts": list(contexts), "concurrency": list(concurrency)}
    return {
        "experiment": {
            "title": {
                "pt": "Escala: grelha sintética de células (sem servidor)",
                "hu": "Skála: szintetikus cellarács (szerver nélkül)",
            },
            "hardware": "synthetic: 4× NVIDIA H100 80GB, one configuration per GPU (TP1)",
        },
        "model": {"path": "Qwen/Qwen3.8-27B-FP8", "served_name": "qwen3.8-27b-fp8"},
        "engine": {
            "command": ["vllm", "serve", "{model}"],
            "args": ["--tensor-parallel-size", "1", "--max-model-len", "262144", "--kv-cache-dtype", "fp8"],
            "env": {},
        },
        "configurations": CONFIGURATIONS,
        "sampling": {
            "temperature": 0.0,
            "target_rel_ci": 0.05,
            "min_samples": MIN_SAMPLES,
            "max_samples": 300,
            "max_duration_s": 1800,
        },
        "workloads": {
            "decode": {**grid, "output_tokens": 128, "warmup_requests": 1, "seed": 2026},
            "single_turn": {**grid, "suffix_tokens": 256, "output_tokens": 64, "warmup_requests": 1, "seed": 2026},
            "multi_turn": {
                **grid,
                "turns": 3,
                "tokens_per_turn": 512,
                "output_tokens": 64,
                "warmup_requests": 1,
                "seed": 2026,
            },
        },
        "slo": {
            "decode": {"tpot_p90_ms": 25},
            "single_turn": {"ttft_p90_ms": 2000},
            "multi_turn": {"ttft_p90_ms": 1500},
        },
        "operations": {
            "host": "127.0.0.1",
            "port_range": [8100, 8199],
            "startup_timeout_s": 1800,
            "request_timeout_s": 1800,
            "shutdown_timeout_s": 60,
            "metrics_interval_s": 1.0,
            "log_level": "WARNING",
        },
        "report": {"languages": ["pt", "hu"]},
    }


# ---- synthetic cells -----------------------------------------------------------------------------------------
@dataclass
class Timeline:
    """One closed-loop session's clock, in ns relative to the measured phase's start."""

    now_ns: int = 0


def _request(
    rng: random.Random,
    perf: Perf,
    label: str,
    session: int,
    seq: int,
    phase: str,
    turn: int,
    prompt: int,
    output: int,
    ttft_s: float,
    slowdown: float,
    start_ns: int,
    failed: bool = False,
) -> RequestRecord:
    """One request as the client records it: sent ~80 µs after it was due, its chunks one decode step apart."""
    r = RequestRecord(label, session, seq, phase, turn, prompt, output)
    r.t0_ns = T0_NS
    r.intended_send_ns = T0_NS + start_ns
    r.sent_ns = r.intended_send_ns + int(rng.uniform(40_000, 140_000))
    if failed:
        r.end_ns = r.sent_ns + int(rng.uniform(0.001, 0.02) * 1e9)
        r.http_status, r.error = 500, "HTTP 500: Internal Server Error"
        return r
    first = r.sent_ns + int(ttft_s * rng.lognormvariate(0, 0.08) * 1e9)
    tokens, left = [1], output - 1
    while left > 0:
        tokens.append(min(left, rng.choice(perf.tokens_per_step)))
        left -= tokens[-1]
    step = perf.itl_s * slowdown
    gaps = np.maximum(1e-4, np.random.default_rng(rng.getrandbits(32)).lognormal(np.log(step), 0.12, len(tokens) - 1))
    r.chunk_tokens = tokens
    r.chunk_ns = [first, *(first + np.cumsum(gaps * 1e9).astype(np.int64)).tolist()]
    r.end_ns = r.chunk_ns[-1] + int(rng.uniform(200_000, 600_000))
    r.prompt_tokens_reported, r.output_tokens_reported = prompt, output
    r.http_status, r.finish_reason = 200, "length"
    return r


def _cell_records(
    experiment: Experiment, cell: CellSpec, rng: random.Random
) -> tuple[list[RequestRecord], dict[str, Any], bool]:
    """A cell's requests, its sampling record and whether it ran past the KV pool."""
    w = experiment.workload(cell.mode).settings
    perf = PERF[cell.configuration]
    conc, ctx, out = cell.sessions, cell.context, w["output_tokens"]
    longest = experiment.longest_request(cell)
    kv_limited = conc * longest > KV_POOL_TOKENS
    load = 1 + 0.22 * (conc - 1) + (2.5 if kv_limited else 0.0)  # prefills queue behind each other
    slowdown = (1 + 0.03 * conc) * (1 + ctx / 250_000)  # decode steps slow with the batch and the context

    def cold(tokens: int) -> float:
        return 0.025 + tokens / perf.prefill_tps

    rounds = [math.ceil(MIN_SAMPLES / conc)]
    if rng.random() < 0.25:  # not yet within the target: a second stage
        rounds.append(max(1, math.ceil(rounds[0] / 2)))
    failed_at = rng.randrange(sum(rounds) * conc) if rng.random() < 0.02 else -1
    recs: list[RequestRecord] = []
    start = -int(40e9)  # warm-ups and probes run before the measured phase

    def unmeasured(phase: str, n: int, prompt: int, ttft: float, turn_of_index: bool = False) -> None:
        nonlocal start
        for i in range(n):
            r = _request(
                rng,
                perf,
                f"{phase}-s0-r{i}-t1",
                0,
                i,
                phase,
                i + 1 if turn_of_index else 1,
                prompt,
                out,
                ttft,
                1.0,
                start,
            )
            recs.append(r)
            start = (r.end_ns or r.sent_ns) - T0_NS + int(2e6)

    if cell.mode == "single_turn":
        prompt = ctx + w["suffix_tokens"]
        unmeasured("probe", 2, prompt, cold(prompt), turn_of_index=True)
        second = cold(w["suffix_tokens"]) if perf.caching else cold(prompt)  # a cache hit where caching is on
        recs[-1].chunk_ns = [recs[-1].sent_ns + int(second * 1e9), *recs[-1].chunk_ns[1:]]
        unmeasured("warmup", w["warmup_requests"], prompt, cold(prompt))
    elif cell.mode == "decode":
        unmeasured("warmup", w["warmup_requests"], ctx, cold(ctx))

    clocks = [Timeline() for _ in range(conc)]
    stages, done, t_stage = [], 0, 0
    for stage_rounds in rounds:
        stage_start = t_stage
        for s in range(conc):
            clocks[s].now_ns = stage_start
            for seq in range(done, done + stage_rounds):
                index = seq * conc + s
                if cell.mode == "multi_turn":
                    for turn in range(1, w["turns"] + 1):
                        prompt = ctx + (turn - 1) * w["tokens_per_turn"] + 7  # the chat template's few tokens
                        new = w["tokens_per_turn"] if perf.caching and turn > 1 else prompt
                        r = _request(
                            rng,
                            perf,
                            f"measured-s{s}-r{seq}-t{turn}",
                            s,
                            seq,
                            "measured",
                            turn,
                            prompt,
                            out,
                            cold(new) * load,
                            slowdown,
                            clocks[s].now_ns,
                            failed=index == failed_at and turn == 2,
                        )
                        recs.append(r)
                        clocks[s].now_ns = (r.end_ns or r.sent_ns) - T0_NS
                else:
                    prompt = ctx + (w["suffix_tokens"] if cell.mode == "single_turn" else 0)
                    new = w["suffix_tokens"] if cell.mode == "single_turn" and perf.caching else prompt
                    r = _request(
                        rng,
                        perf,
                        f"measured-s{s}-r{seq}-t1",
                        s,
                        seq,
                        "measured",
                        1,
                        prompt,
                        out,
                        cold(new) * load,
                        slowdown,
                        clocks[s].now_ns,
                        failed=index == failed_at,
                    )
                    recs.append(r)
                    clocks[s].now_ns = (r.end_ns or r.sent_ns) - T0_NS
        t_stage = max(c.now_ns for c in clocks) + int(0.5e9)  # the pause between stages
        stages.append(
            {
                "start_s": stage_start / 1e9,
                "end_s": (t_stage - int(0.5e9)) / 1e9,
                "rounds": stage_rounds,
                "n_before": done * conc,
                "n_after": (done + stage_rounds) * conc,
            }
        )
        done += stage_rounds
    if cell.mode == "multi_turn":  # its warm-up conversation ran first; listed last, as the order does not matter
        for turn in range(1, w["turns"] + 1):
            prompt = ctx + (turn - 1) * w["tokens_per_turn"] + 7
            recs.append(
                _request(
                    rng,
                    perf,
                    f"warmup-s0-r0-t{turn}",
                    0,
                    0,
                    "warmup",
                    turn,
                    prompt,
                    out,
                    cold(prompt),
                    1.0,
                    -int(30e9) + turn * int(3e9),
                )
            )
    sampled = {
        "reason": "precise" if len(rounds) == 1 or rng.random() < 0.7 else "max_samples",
        "rule": experiment.cell_settings(cell)["sampling"]["rule"],
        "stages": stages,
        "stop_rel_half_width": rng.uniform(0.02, 0.05),
    }
    return recs, sampled, kv_limited


def _server_metrics(
    experiment: Experiment,
    cell: CellSpec,
    recs: list[RequestRecord],
    kv_limited: bool,
    duration_s: float,
    rng: random.Random,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cell's server metrics as servegrid.measuring.measured_phase records them, and its one repeat's record."""
    conf = experiment.configuration(cell.configuration)
    measured = [r for r in recs if r.phase == "measured"]
    frame = pd.DataFrame(
        {
            "session": [r.session for r in measured],
            "seq": [r.seq for r in measured],
            "turn": [r.turn for r in measured],
            "prompt_tokens_reported": [r.prompt_tokens_reported or r.prompt_tokens_requested for r in measured],
        }
    )
    settings = CellSettings(experiment.cell_settings(cell))
    expected = modes.get(cell.mode).expected_hit_rate(conf.prefix_caching, settings, frame, PrefixCache(block=BLOCK))
    prompt_tokens = float(sum(r.prompt_tokens_requested for r in measured))
    timed = [r for r in measured if r.chunk_ns]
    ttft = [(r.chunk_ns[0] - r.sent_ns) / 1e9 for r in timed]
    tpot = [((r.end_ns or 0) - r.chunk_ns[0]) / 1e9 / max(1, (r.output_tokens_reported or 1) - 1) for r in timed]
    generated = float(sum(r.output_tokens_reported or 0 for r in measured))
    delta: dict[str, float | None] = dict.fromkeys(metrics.COUNTERS)
    delta.update(
        prefix_cache_queries=prompt_tokens,
        prefix_cache_hits=prompt_tokens * min(1.0, expected * rng.uniform(1.0, 1.04)),
        num_preemptions=float(rng.randint(1, 40)) if kv_limited and rng.random() < 0.5 else 0.0,
        prompt_tokens=prompt_tokens,
        generation_tokens=generated,
        time_to_first_token_seconds_sum=sum(ttft) - 0.003 * len(ttft),
        time_to_first_token_seconds_count=float(len(ttft)),
        request_time_per_output_token_seconds_sum=sum(tpot) - 0.0001 * len(tpot),
        request_time_per_output_token_seconds_count=float(len(tpot)),
    )
    if conf.speculative:
        chunks = sum(len(r.chunk_tokens) - 1 for r in timed)
        accepted = sum(sum(r.chunk_tokens) - len(r.chunk_tokens) for r in timed)
        delta.update(
            spec_decode_num_drafts=float(chunks),
            spec_decode_num_draft_tokens=float(3 * chunks),
            spec_decode_num_accepted_tokens=float(accepted),
        )
    before = {k: float(rng.randint(10**5, 10**8)) for k in metrics.COUNTERS}
    after = {k: before[k] + (v or 0.0) for k, v in delta.items()}
    usage_top = rng.uniform(0.985, 1.0) if kv_limited else min(0.9, cell.sessions * 1e-5 * cell.context / 4)
    samples = [
        {
            "t": float(t),
            "kv_cache_usage_perc": usage_top * rng.uniform(0.6, 1.0),
            "num_requests_running": float(rng.randint(max(1, cell.sessions // 2), cell.sessions)),
            "num_requests_waiting": float(rng.randint(0, 4)) if kv_limited else 0.0,
            "num_requests_waiting_capacity": float(rng.randint(1, 4)) if kv_limited else 0.0,
        }
        for t in np.arange(0.0, min(duration_s, 120.0), 1.0)
    ]
    gauges: dict[str, Any] = {"samples": len(samples), "scrape_errors": 0}
    for gauge in metrics.GAUGES:
        series = [s[gauge] for s in samples]
        gauges[f"{gauge}_max"] = max(series) if series else None
        gauges[f"{gauge}_mean"] = float(np.mean(series)) if series else None
    if kv_limited and samples:
        gauges["kv_cache_usage_perc_max"] = usage_top
    repeat = {
        "repeat": 0,
        "cache_state": "reset",
        "duration_s": duration_s,
        "before": before,
        "after": after,
        "delta": delta,
        "gauge_samples": samples,
    }
    return {"delta": delta, "derived": metrics.derived(delta), "gauges": gauges}, repeat


def server_facts(experiment: Experiment, name: str, index: int) -> state.ServerFacts:
    spec = experiment.public_launch_spec(name)
    session = f"20261203T0{index}0000-scale{index}"
    return state.ServerFacts(
        configuration=name,
        engine="vllm",
        session=session,
        spec_hash=spec_hash(spec),
        url=f"http://127.0.0.1:{8100 + index}",
        argv=[
            "vllm",
            "serve",
            spec["model"],
            "--host",
            "127.0.0.1",
            "--port",
            str(8100 + index),
            "--served-model-name",
            spec["served_name"],
            f"servegrid-{session}",
            *spec["args"],
        ],
        env={"CUDA_VISIBLE_DEVICES": str(index)},
        gpus=[index],
        log_path=f"results/servers/{name}/logs/{session}.log",
        engine_version="0.32.0",
        kv_cache_tokens=KV_POOL_TOKENS,
        max_concurrency=5.03,
        max_model_len=262144,
        startup_s=96.4 + index,
        warmup_s=1.3,
        started_at=f"2026-12-03T0{index}:00:00+0000",
        host={
            "cpu": "AMD EPYC 9654",
            "cpu_count": 192,
            "memory_gib": 1510.0,
            "os": "Linux 6.8",
            "machine": "x86_64",
            "hostname": "gpu-host",
            "gpus": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB"} for i in range(4)],
        },
        block_size=BLOCK,
    )


def write_cell(experiment: Experiment, cell: CellSpec, facts: state.ServerFacts, rng: random.Random) -> int:
    """One synthetic cell file, as servegrid.pipeline.cell_job writes it; returns its number of rows."""
    recs, sampled, kv_limited = _cell_records(experiment, cell, rng)
    duration_s = sum(s["end_s"] - s["start_s"] for s in sampled["stages"])
    server_metrics, repeat = _server_metrics(experiment, cell, recs, kv_limited, duration_s, rng)
    lag = rng.uniform(0.0003, 0.0015)
    client = {
        "cpu_fraction": rng.uniform(0.05, 0.3),
        "cpus": [],
        "loop_lag_max_s": lag * 2,
        "loop_lag_p50_s": lag / 5,
        "loop_lag_p99_s": lag,
        "loop_lag_samples": int(duration_s * 100),
    }
    phase = {
        "server_metrics": server_metrics,
        "client": client,
        "repeats": [repeat | {"sampling": sampled}],
        "duration_s": duration_s,
        "sampling": sampled,
        "cache_state": "reset",
    }
    record = CellRecord.measured(
        cell,
        experiment.cell_settings(cell),
        asdict(facts),
        phase,
        started_at="2026-12-03T10:00:00.000+00:00",
        ended_at="2026-12-03T10:05:00.000+00:00",
    )
    cell_file.write_cell(cell.path, recs, record)
    return len(recs)


def write_grid(experiment: Experiment) -> dict[str, Any]:
    """Specs, cells and stop records of the whole grid, in the working directory, dated in DAG order."""
    base = time.time() - 3600
    facts = {name: server_facts(experiment, name, i) for i, name in enumerate(experiment.configurations)}
    for name in experiment.configurations:
        spec = paths.SERVER_SPEC_PATTERN.format(configuration=name)
        atomic.write_json(spec, experiment.public_launch_spec(name))  # what the server_spec job writes
        os.utime(spec, (base, base))
    rows = 0
    for cell in experiment.cells():
        rows += write_cell(experiment, cell, facts[cell.configuration], random.Random(cell.id))
        os.utime(cell.path, (base + 60, base + 60))
    for name in experiment.configurations:
        stop = paths.server_stop(name)
        stopped = [{"session": facts[name].session, "was_running": True}]
        atomic.write_json(
            stop, {"configuration": name, "stopped_at": "2026-12-03T11:00:00.000+00:00", "stopped": stopped}
        )
        os.utime(stop, (base + 120, base + 120))
    size = sum(Path(c.path).stat().st_size for c in experiment.cells())
    return {"rows": rows, "cell_bytes": size}


# ---- measuring -----------------------------------------------------------------------------------------------
@dataclass
class Measured:
    seconds: float
    peak_mib: float
    log: str


@dataclass
class SizeResult:
    cells: int
    contexts: int
    concurrency: int
    rows: int
    cell_mib: float
    generate_s: float
    stages: dict[str, Measured] = field(default_factory=dict)


def run_measured(argv: list[str], cwd: Path, log: Path) -> Measured:
    """Run ``argv`` in ``cwd``: its wall time and the peak RSS of its largest process; fails loudly on error."""
    env = os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "MPLBACKEND": "Agg"}
    with log.open("w") as out:
        started = time.perf_counter()
        child = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    text = log.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({code}) in {cwd}:\n{text[-3000:]}")
    return Measured(seconds, usage.ru_maxrss / 1024, text)


def planned_jobs(text: str) -> dict[str, int]:
    """The ``Job stats`` table of a Snakemake dry run: rule → count."""
    jobs: dict[str, int] = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "Job stats:":
            for row in lines[i + 3 :]:
                parts = row.split()
                if len(parts) != 2 or not parts[1].isdigit():
                    break
                jobs[parts[0]] = int(parts[1])
            break
    return jobs


def measure_size(size: int, workdir: Path) -> SizeResult:
    contexts, concurrency = grid_shape(size)
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, workdir / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, workdir / name)
    (workdir / "config").mkdir()
    config = yaml.safe_dump(config_for(contexts, concurrency), sort_keys=False, allow_unicode=True)
    (workdir / CONFIG).write_text(config)
    logs = workdir / "scale-logs"
    logs.mkdir()
    os.chdir(workdir)  # the package's paths are relative to the working directory
    experiment = Experiment.from_file(CONFIG)
    cells = len(experiment.cells())
    print(
        f"\n== {cells} cells ({len(experiment.configurations)} configurations × 3 modes × {len(contexts)} contexts "
        f"× {len(concurrency)} concurrency levels) in {workdir}",
        flush=True,
    )
    started = time.perf_counter()
    written = write_grid(experiment)
    result = SizeResult(
        cells,
        len(contexts),
        len(concurrency),
        written["rows"],
        written["cell_bytes"] / 2**20,
        time.perf_counter() - started,
    )
    print(
        f"   wrote {cells} cell files, {result.rows} rows, {result.cell_mib:.1f} MiB in {result.generate_s:.1f} s",
        flush=True,
    )
    snakemake = [str(BIN / "snakemake")]
    dry_run = [*snakemake, "-n", "report", "--configfile", CONFIG]
    cli = [str(BIN / "servegrid"), "--config", CONFIG]
    # Snakemake keeps a record (.snakemake/metadata) of each output it made and reruns a job whose record is
    # missing ("Code has changed"): --touch makes the records, and dates the files in DAG order.
    stops = [paths.server_stop(name) for name in experiment.configurations]
    stages: list[tuple[str, list[str]]] = [
        ("setup: --touch cells", [*snakemake, "--cores", "1", "--touch", *stops, "--configfile", CONFIG]),
        ("dry run", dry_run),
        ("aggregate", [*cli, "aggregate"]),
        ("figures (pt+hu)", [*cli, "figures"]),
        ("report html pt", [*cli, "report", "--lang", "pt", "--format", "html"]),
        ("report pdf pt", [*cli, "report", "--lang", "pt", "--format", "pdf"]),
        ("report html hu", [*cli, "report", "--lang", "hu", "--format", "html"]),
        ("report pdf hu", [*cli, "report", "--lang", "hu", "--format", "pdf"]),
        ("setup: --touch report", [*snakemake, "--cores", "1", "--touch", "report", "--configfile", CONFIG]),
        ("DAG (nothing to do)", dry_run),
    ]
    for name, argv in stages:
        measured = run_measured(argv, workdir, logs / f"{len(result.stages)}-{name.split()[0].strip(':')}.log")
        result.stages[name] = measured
        print(f"   {name:<22} {measured.seconds:8.2f} s {measured.peak_mib:8.0f} MiB", flush=True)
        if name == "dry run":
            jobs = planned_jobs(measured.log)
            wanted = {"aggregate": 1, "figures": 2, "report_html": 2, "report_pdf": 2, "report": 1, "total": 8}
            if jobs != wanted:
                raise SystemExit(f"the dry run plans {jobs}, not only the downstream jobs {wanted}")
        if name == "DAG (nothing to do)" and "Nothing to be done" not in measured.log:
            raise SystemExit(f"the second dry run still plans jobs:\n{measured.log[-2000:]}")
    summary = pd.read_parquet(paths.SUMMARY_TABLE)
    print(
        f"   summary: {len(summary)} cells, {int(summary['valid'].sum())} valid, "
        f"{int(summary['kv_limited'].sum())} KV-limited; "
        f"{len(pd.read_parquet(paths.COMPARISONS_TABLE))} compared groups; "
        f"PDF pages: {_pdf_pages(Path(paths.REPORT_PATTERN.format(lang='pt', ext='pdf')))}",
        flush=True,
    )
    return result


def _pdf_pages(pdf: Path) -> str:
    try:
        text = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        return "?"
    return next((line.split()[-1] for line in text.splitlines() if line.startswith("Pages:")), "?")


# ---- the table -----------------------------------------------------------------------------------------------
def table(results: list[SizeResult]) -> dict[str, Any]:
    sizes = [r.cells for r in results]
    rows = []
    for stage in results[0].stages:
        seconds = [r.stages[stage].seconds for r in results]
        peaks = [r.stages[stage].peak_mib for r in results]
        growth = [(seconds[i + 1] / seconds[i]) / (sizes[i + 1] / sizes[i]) for i in range(len(sizes) - 1)]
        marginal = [(seconds[i + 1] - seconds[i]) / (sizes[i + 1] - sizes[i]) * 1000 for i in range(len(sizes) - 1)]
        flags = []
        if seconds[-1] > LIMIT_S:
            flags.append(f"over {LIMIT_S:.0f} s")
        worse = any(g > SUPERLINEAR for g in growth) or (
            len(marginal) > 1 and marginal[0] > 0 and marginal[-1] / marginal[0] > SUPERLINEAR
        )
        if worse:
            flags.append("worse than linear")
        rows.append(
            {
                "stage": stage,
                "seconds": seconds,
                "peak_mib": peaks,
                "growth": growth,
                "marginal_ms_per_cell": marginal,
                "flags": flags,
            }
        )
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "sizes": [
            {
                "cells": r.cells,
                "contexts": r.contexts,
                "concurrency": r.concurrency,
                "rows": r.rows,
                "cell_mib": round(r.cell_mib, 1),
                "generate_s": round(r.generate_s, 1),
            }
            for r in results
        ],
        "stages": rows,
        "limit_s": LIMIT_S,
        "superlinear_threshold": SUPERLINEAR,
    }


def print_table(data: dict[str, Any]) -> None:
    sizes = [s["cells"] for s in data["sizes"]]
    steps = [f"{a}→{b}" for a, b in itertools.pairwise(sizes)]
    head = (
        ["stage"]
        + [f"{n} cells s / MiB" for n in sizes]
        + [f"growth {s}" for s in steps]
        + [f"ms/cell {s}" for s in steps]
        + ["flag"]
    )
    lines = [head]
    for row in data["stages"]:
        lines.append(
            [row["stage"]]
            + [f"{s:.2f} / {m:.0f}" for s, m in zip(row["seconds"], row["peak_mib"], strict=True)]
            + [f"{g:.2f}" for g in row["growth"]]
            + [f"{m:.1f}" for m in row["marginal_ms_per_cell"]]
            + [", ".join(row["flags"]) or "-"]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    print()
    for i, line in enumerate(lines):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for s in data["sizes"]:
        print(
            f"  {s['cells']} cells: {s['contexts']} contexts × {s['concurrency']} concurrency levels × 3 modes × "
            f"4 configurations; {s['rows']} request rows, {s['cell_mib']} MiB of cell files "
            f"(written in {s['generate_s']} s)"
        )
    print("  growth: (time ratio) / (cell ratio), 1.0 = linear; ms/cell: extra time per extra cell between sizes")


# ---- the grid's progress line (each cell job, as it starts) ----------------------------------------------------------
GRID_LINE_OUT = REPO / "benchmarks" / "out" / "grid_line.json"
GRID_LINE_MISSING = 0.10  # of the grid's cells have no file yet (the run is under way: the line has an ETA)
GRID_LINE_STALE = 0.05  # of the grid's files were measured with other settings (a config edit): not counted


def grid_line_before(experiment: Experiment, cell: CellSpec) -> str:
    """The grid line as servegrid.pipeline.cell_job wrote it up to commit 47f9ef4: every cell file's footer read for
    its settings, and the most recent ones again for their wall time."""
    from servegrid import progress

    def up_to_date(path: str, settings: dict[str, object]) -> bool:
        try:
            return bool(cell_file.read_record(path).settings == settings)
        except Exception:  # noqa: BLE001 - as the old code: (OSError, ValueError, ArrowException, CellFileError)
            return False

    def wall_s(path: Path) -> float | None:
        try:
            return cell_file.read_record(path).wall_s
        except Exception:  # noqa: BLE001 - as the old code
            return None

    cells = experiment.cells()
    present = [Path(c.path) for c in cells if up_to_date(c.path, experiment.cell_settings(c))]
    left = len(cells) - len(present)
    line = f"grid: {len(present)} of {len(cells)} cells measured, starting {cell.id}"
    recent = sorted(present, key=lambda p: p.stat().st_mtime)[-20:]
    walls = [w for w in map(wall_s, recent) if w is not None]
    if walls and left:
        mean = sum(walls) / len(walls)
        line += (
            f"; about {progress.duration(mean * left)} left "
            f"({progress.duration(mean)} a cell over the last {len(walls)})"
        )
    return line


def _timed(fn: Any, repeat: int = 1) -> tuple[float, Any]:
    """The median wall time of ``repeat`` calls of ``fn``, and its last result."""
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times)), result


def measure_grid_line(size: int, workdir: Path) -> dict[str, Any]:
    """The grid line at about ``size`` cells, old way and new way, in ``workdir``: every cell file written with a
    cell job's footer (server facts, metrics, gauges, sampling stages; the rows of one cell per configuration and
    mode, which the line does not read), 10% of the cells not yet measured and 5% measured with other settings."""
    from servegrid.pipeline import grid_progress

    per_list = size / (len(CONFIGURATIONS) * 3)
    k = max(1, round(math.sqrt(per_list)))
    contexts = tuple(1024 * (i + 1) for i in range(max(1, round(per_list / k))))
    concurrency = tuple(range(1, k + 1))
    os.chdir(workdir)
    Path(CONFIG).parent.mkdir(parents=True, exist_ok=True)
    Path(CONFIG).write_text(yaml.safe_dump(config_for(contexts, concurrency), sort_keys=False, allow_unicode=True))
    experiment = Experiment.from_file(CONFIG)
    cells = experiment.cells()
    print(
        f"\n== grid line: {len(cells)} cells ({len(contexts)} contexts × {len(concurrency)} concurrency levels × "
        f"3 modes × 4 configurations) in {workdir}",
        flush=True,
    )
    rng = random.Random(2026)
    facts = {name: server_facts(experiment, name, i) for i, name in enumerate(experiment.configurations)}
    templates: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
    started = time.perf_counter()
    base = time.time() - 86400
    written = 0
    for i, cell in enumerate(cells):
        if rng.random() < GRID_LINE_MISSING:
            continue
        key = (cell.configuration, cell.mode)
        if key not in templates:
            write_cell(experiment, cell, facts[cell.configuration], random.Random(cell.id))
            table, meta = cell_file.read_cell(cell.path)
            templates[key] = (table, meta)
        table, meta = templates[key]
        wall = rng.uniform(60, 600)
        settings = experiment.cell_settings(cell) if rng.random() >= GRID_LINE_STALE else {"an": "older config"}
        start, end = (
            datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
            for t in (base + i * 10, base + i * 10 + wall)
        )
        _write_like(cell.path, table, replace(meta, spec=cell, settings=settings, started_at=start, ended_at=end))
        os.utime(cell.path, (base + i * 10 + wall, base + i * 10 + wall))
        written += 1
    footer_kib = len(json.dumps(next(iter(templates.values()))[1].facts()).encode()) / 1024
    print(
        f"   wrote {written} cell files (footers of about {footer_kib:.0f} KiB) in "
        f"{time.perf_counter() - started:.1f} s",
        flush=True,
    )
    current = cells[-1]
    figures: dict[str, float] = {}
    figures["before: footers, every job"], before = _timed(lambda: grid_line_before(experiment, current), 3)
    index = Path(grid_progress.INDEX)
    index.unlink(missing_ok=True)
    figures["after: no index yet (rebuilt once)"], first = _timed(lambda: grid_progress.grid_line(experiment, current))
    figures["after: index, every job"], after = _timed(lambda: grid_progress.grid_line(experiment, current), 9)
    if not before == first == after:
        raise SystemExit(f"the lines differ:\n  before: {before}\n  after (rebuilt): {first}\n  after: {after}")
    # What the line's own time is made of, and the cell job's update of the index after writing its cell.
    figures["  of which: the grid's cells"], _ = _timed(experiment.cells, 5)
    settings_s, _ = _timed(lambda: [experiment.cell_settings(c) for c in cells], 3)
    figures["  of which: cell_settings, every cell"] = settings_s
    # cell_settings' copy of the sampling rule: asdict's deep copy before, a field-by-field copy now.
    rule = next(r for r in experiment.sampling_rules.values() if r is not None)
    figures["  (its rule copied by asdict, before)"], _ = _timed(lambda: [asdict(rule) for _ in cells], 3)
    figures["  (its rule copied by rule_fields, now)"], _ = _timed(lambda: [rule_fields(rule) for _ in cells], 3)
    hashes = [experiment.cell_settings(c) for c in cells]
    figures["  of which: their hash, every cell"], _ = _timed(
        lambda: [grid_progress.settings_hash(s) for s in hashes], 3
    )
    figures["  of which: a stat per cell"], _ = _timed(lambda: [os.path.exists(c.path) for c in cells], 3)
    figures["  of which: reading the index"], _ = _timed(grid_progress._load, 5)
    present = [c for c in cells if os.path.exists(c.path)]
    recorded = iter(present * 2)

    def record() -> None:
        cell = next(recorded)
        grid_progress.record(cell, cell.path, cell_file.metadata(cell.path, _footer(cell.path)))

    figures["after: the cell job's index update"], _ = _timed(record, 9)
    index_kib = index.stat().st_size / 1024
    print(f"   the line (the same both ways): {after}", flush=True)
    for name, seconds in figures.items():
        print(f"   {name:<40} {seconds * 1000:10.1f} ms", flush=True)
    print(f"   index: {index_kib:.0f} KiB for {written} cell files", flush=True)
    per_job_before = figures["before: footers, every job"]
    per_job_after = figures["after: index, every job"] + figures["after: the cell job's index update"]
    print(
        f"   per cell job at {len(cells)} cells: {per_job_before:.2f} s before, {per_job_after:.3f} s after "
        f"({per_job_before / per_job_after:.0f}× less)",
        flush=True,
    )
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "cells": len(cells),
        "cell_files": written,
        "footer_kib": round(footer_kib, 1),
        "index_kib": round(index_kib),
        "line": after,
        "seconds": {name.strip(): round(s, 4) for name, s in figures.items()},
    }


def _footer(path: str) -> dict[bytes, bytes]:
    import pyarrow.parquet as pq

    return pq.read_schema(path).metadata


def _write_like(path: str, table: Any, meta: CellRecord) -> None:
    """``table``'s rows with ``meta`` as the cell's footer, written as cell_file.write_cell writes it (fsync'd)."""
    import pyarrow.parquet as pq

    schema = cell_file.CELL_SCHEMA.with_metadata(cell_format.encode(meta.facts()))
    with atomic.atomic_path(path) as tmp:
        pq.write_table(table.cast(schema), tmp, write_page_checksum=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[200, 1000, 2000], help="about how many cells")
    parser.add_argument("--keep", action="store_true", help="keep the temporary working directories")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the JSON table (default: {OUT.relative_to(REPO)})")
    parser.add_argument(
        "--grid-line",
        type=int,
        default=10_000,
        metavar="CELLS",
        help="the grid's progress line at about this many cells, old way and new (0: not measured)",
    )
    parser.add_argument("--grid-line-only", action="store_true", help="only the grid line, not the stages")
    args = parser.parse_args()
    if args.grid_line:
        workdir = Path(tempfile.mkdtemp(prefix=f"servegrid-scale-grid-line-{args.grid_line}-"))
        try:
            measured = measure_grid_line(args.grid_line, workdir)
        finally:
            os.chdir(REPO)
            shutil.rmtree(workdir, ignore_errors=True) if not args.keep else print(f"   kept {workdir}")
        GRID_LINE_OUT.parent.mkdir(parents=True, exist_ok=True)
        GRID_LINE_OUT.write_text(json.dumps(measured, indent=2) + "\n")
        print(f"   wrote {GRID_LINE_OUT}")
    if args.grid_line_only:
        return 0
    results = []
    for size in sorted(args.sizes):
        workdir = Path(tempfile.mkdtemp(prefix=f"servegrid-scale-{size}-"))
        try:
            results.append(measure_size(size, workdir))
        finally:
            os.chdir(REPO)
            if args.keep:
                print(f"   kept {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    data = table(results)
    print_table(data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
