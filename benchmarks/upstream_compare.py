"""servegrid's client side by side with `vllm bench serve`, on the same vLLM CPU server.

For each configuration of the CPU demo (prefix caching; ngram speculation) one
real vLLM server is started. Then, in rounds, both clients send the very same
requests: a fresh set of random 1024-token prompts per round (built with
servegrid's prompt builder, given to upstream as a custom dataset), exactly 128
output tokens (ignore_eos, min_tokens; upstream gets servegrid's extra request
fields through --extra-body), temperature 0, closed loop at concurrency 1 and 4.
Before each client's turn the server's prefix cache is emptied and one
unmeasured request warms it up; which client goes first alternates by round.
Both clients are pinned to the demo's client core, the server to its server
core (config/cpu-demo.yaml), so that neither slows the engine down for the other.

Reported per configuration and concurrency: TTFT p50 and TPOT p50 of each
client and their ratio (servegrid / upstream) over all requests, and the
median of the per-round ratios with a 95% bootstrap interval over rounds (the
server's speed drifts from round to round on a shared machine; within a round
both clients see the same server); and servegrid's per-token ITL beside the
per-chunk gaps that upstream calls ITL.

    .venv/bin/python benchmarks/upstream_compare.py [--rounds 4] [--requests 16] [--out benchmarks/out]

On a GPU host, name its config and the interpreter of its vLLM: the servers
are then the config's own (model, engine, GPUs), and `vllm bench serve` runs
from that vLLM:

    .venv/bin/python benchmarks/upstream_compare.py --config config.yaml --vllm-python /opt/vllm/bin/python

Target (issue 6): within ±3% on TTFT and TPOT. The script also prints each
client against itself (even rounds over odd rounds): the noise floor below
which no comparison on this server can resolve a difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from servegrid import aggregate, model, procs, records, server, stats
from servegrid.cell import reset_prefix_cache, run_loop
from servegrid.client import CollectorPause, RequestRecord, Streamer, streaming_session
from servegrid.config import Experiment
from servegrid.prompts import PromptBuilder

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROMPT_TOKENS, OUTPUT_TOKENS = 1024, 128
EXTRA_BODY = {"min_tokens": OUTPUT_TOKENS, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def experiment(out: Path, config: Path | None, vllm_python: Path) -> Experiment:
    """The config's experiment as it is; without one, the CPU demo's, with its tiny model built under ``out``."""
    if config is not None:
        return Experiment.from_file(config)
    raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw["model"]["path"] = str(out / "model")
    raw["engine"]["command"][0] = str(vllm_python)
    raw["engine"]["args"] = ["--load-format", "dummy", "--max-model-len", "4096"]
    exp = Experiment(raw, source="upstream_compare")
    model.build(out / "model", model.TinyModelSpec(**exp.tiny_model_spec()))
    return exp


def client_cores(exp: Experiment) -> set[int]:
    """The demo's client core (operations.client_cpus, away from the server's); else the last CPU."""
    return set(exp.operations["client_cpus"] or [sorted(os.sched_getaffinity(0))[-1]])


def prompt_texts(url: str, served: str, count: int, label: str) -> list[str]:
    """``count`` cold prompts of 1024 tokens as text (what both clients send)."""
    with httpx.Client(timeout=60) as client:

        def tokenize(text: str) -> list[int]:
            reply = client.post(f"{url}/tokenize", json={"model": served, "prompt": text, "add_special_tokens": False})
            return list(reply.json()["tokens"])

        builder = PromptBuilder(tokenize, seed=11, corpus_tokens=8192)
        ids = [builder.unique(PROMPT_TOKENS, f"{label} {i}") for i in range(count)]
        return [client.post(f"{url}/detokenize", json={"model": served, "tokens": t}).json()["prompt"] for t in ids]


def warm_and_reset(url: str, served: str, label: str) -> None:
    with httpx.Client(timeout=300) as client:
        reset_prefix_cache(client, url)
        text = prompt_texts(url, served, 1, f"warm {label}")[0]
        client.post(f"{url}/v1/completions", json={"model": served, "prompt": text, "max_tokens": 8}).raise_for_status()


async def servegrid_client(url: str, served: str, prompts: list[str], concurrency: int) -> list[RequestRecord]:
    """Closed loop, the way a decode cell runs: connections opened and the cyclic GC paused before the
    measured requests, streams decoded after them; session s sends prompts s, s+c, s+2c, ..."""
    async with streaming_session(concurrency + 2, 600) as session:
        streamer = Streamer(session, url)
        done: list[RequestRecord] = []

        async def session(s: int) -> None:
            for i in range(s, len(prompts), concurrency):
                record = RequestRecord(f"p{i}", s, i, "measured", 1, PROMPT_TOKENS, OUTPUT_TOKENS)
                record.intended_send_ns = record.t0_ns = time.monotonic_ns()
                payload = {"model": served, "prompt": prompts[i], "max_tokens": OUTPUT_TOKENS,
                           "min_tokens": OUTPUT_TOKENS, "ignore_eos": True, "temperature": 0}  # fmt: skip
                await streamer.stream("/v1/completions", payload, record, decode=False)
                done.append(record)

        await streamer.open_connections(concurrency)
        collector = CollectorPause()
        collector.start()
        try:
            await asyncio.gather(*(session(s) for s in range(concurrency)))
        finally:
            collector.stop()
        streamer.decode_pending()
    return done


def servegrid_run(url: str, served: str, prompts: list[str], concurrency: int) -> dict[str, list[float]]:
    frame = aggregate.derive(records.to_frame(run_loop(servegrid_client(url, served, prompts, concurrency))))
    frame = frame[frame["error"].isna()]
    itl = [aggregate.per_token_itl(t, k) for t, k in zip(frame["chunk_times_s"], frame["chunk_tokens"], strict=True)]
    gaps = [np.diff(np.asarray(t, dtype=float)) for t in frame["chunk_times_s"]]
    return {
        "ttft": frame["ttft_s"].tolist(),
        "tpot": frame["tpot_s"].tolist(),
        "itl_token": np.concatenate(itl).tolist() if itl else [],
        "chunk_gap": np.concatenate(gaps).tolist() if gaps else [],
    }


def upstream_run(url: str, served: str, tokenizer: str, prompts: list[str], concurrency: int,
                 out: Path, vllm_python: Path) -> dict[str, list[float]]:  # fmt: skip
    stamp = time.monotonic_ns()
    dataset = out / f"prompts-{stamp}.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result = out / f"upstream-{stamp}.json"
    done = subprocess.run(
        [str(vllm_python), str(REPO / "benchmarks" / "upstream_bench.py"), "--backend", "vllm",
         "--base-url", url, "--model", served, "--tokenizer", tokenizer,
         "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", str(OUTPUT_TOKENS),
         "--skip-chat-template", "--no-oversample", "--num-prompts", str(len(prompts)),
         "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--num-warmups", "0",
         "--extra-body", json.dumps(EXTRA_BODY), "--disable-tqdm",
         "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", result.name],
        check=False, capture_output=True, text=True, timeout=1200,  # on our client core: inherited
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    data = json.loads(result.read_text())
    result.unlink()
    dataset.unlink()
    tpots = [sum(itl) / (n - 1) for itl, n in zip(data["itls"], data["output_lens"], strict=True) if n > 1 and itl]
    return {"ttft": [t for t in data["ttfts"] if t], "tpot": tpots, "chunk_gap": [g for i in data["itls"] for g in i]}


def interval(bounds: tuple[float | None, float | None]) -> str:
    low, high = bounds
    return "no CI: too few values" if low is None or high is None else f"CI {low:.3f}-{high:.3f}"


def ratio_row(name: str, concurrency: int, ours: dict, theirs: dict) -> dict:
    p50 = lambda values: float(np.median(values)) * 1e3  # noqa: E731 - ms
    row = {"configuration": name, "concurrency": concurrency, "requests_each": len(ours["ttft"])}
    for metric in ("ttft", "tpot"):
        row[f"{metric}_p50_ms"] = {"servegrid": p50(ours[metric]), "upstream": p50(theirs[metric])}
        row[f"{metric}_ratio"] = row[f"{metric}_p50_ms"]["servegrid"] / row[f"{metric}_p50_ms"]["upstream"]
        row[f"{metric}_ratio_ci"] = stats.ratio_of_medians_ci(ours[metric], theirs[metric])
    row["itl_p50_ms"] = {
        "servegrid_per_token": p50(ours["itl_token"]),
        "servegrid_per_chunk": p50(ours["chunk_gap"]),
        "upstream_per_chunk": p50(theirs["chunk_gap"]),
    }
    row["within_3_percent"] = all(abs(row[f"{m}_ratio"] - 1) <= 0.03 for m in ("ttft", "tpot"))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=12, help="prompts per round and concurrency (both clients)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    parser.add_argument("--config", type=Path, help="a GPU host's config (default: the CPU demo's, tiny model)")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="the interpreter of the vLLM to run")
    parser.add_argument("--configurations", nargs="+", help="only these configurations (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    exp = experiment(args.out, args.config, args.vllm_python)
    unknown = sorted(set(args.configurations or []) - set(exp.configurations))
    if unknown:
        parser.error(
            f"--configurations: {', '.join(unknown)} not in the config (it has {', '.join(exp.configurations)})"
        )
    tokenizer = exp.raw["model"]["path"]
    runtime = server.Runtime(port_range=(8400, 8499), startup_timeout_s=exp.operations["startup_timeout_s"],
                             shutdown_timeout_s=20, state_dir=str(args.out / "state"), cwd=str(REPO))  # fmt: skip
    owner = procs.ProcessRef.of(os.getpid())
    served = exp.raw["model"]["served_name"]
    all_cpus = os.sched_getaffinity(0)
    rows = []
    try:
        for name in args.configurations or exp.configurations:
            os.sched_setaffinity(0, all_cpus)  # the server, our child, gets the demo's server cores
            runtime.cpus = list(exp.configurations[name].get("cpus") or [])
            runtime.gpus = list(exp.configurations[name].get("gpus") or [])
            facts = server.ensure(exp.launch_spec(name), runtime, owner)
            os.sched_setaffinity(0, client_cores(exp))
            pooled: dict[tuple[str, int], dict[str, list[float]]] = {}
            for round_ in range(args.rounds):
                for concurrency in args.concurrency:
                    prompts = prompt_texts(facts.url, served, args.requests, f"{name} r{round_} c{concurrency}")
                    order = ("servegrid", "upstream") if round_ % 2 == 0 else ("upstream", "servegrid")
                    for tool in order:
                        warm_and_reset(facts.url, served, f"{tool} r{round_} c{concurrency}")
                        run = (
                            servegrid_run(facts.url, served, prompts, concurrency)
                            if tool == "servegrid"
                            else upstream_run(
                                facts.url, served, tokenizer, prompts, concurrency, args.out, args.vllm_python
                            )
                        )
                        for key in (
                            (tool, concurrency),
                            (tool, concurrency, round_ % 2),
                            (tool, concurrency, "r", round_),
                        ):
                            bucket = pooled.setdefault(key, {})
                            for metric, values in run.items():
                                bucket.setdefault(metric, []).extend(values)
            server.stop(name, runtime, reason="comparison done")
            for concurrency in args.concurrency:
                row = ratio_row(name, concurrency, pooled[("servegrid", concurrency)],
                                pooled[("upstream", concurrency)])  # fmt: skip
                # Paired by round: the server drifts between rounds, both clients see each round's state.
                for metric in ("ttft", "tpot"):
                    per_round = [
                        float(np.median(pooled[("servegrid", concurrency, "r", r)][metric]))
                        / float(np.median(pooled[("upstream", concurrency, "r", r)][metric]))
                        for r in range(args.rounds)
                    ]
                    row[f"{metric}_paired_ratio"] = float(np.median(per_round))
                    row[f"{metric}_paired_ratio_ci"] = stats.median_ci(per_round)
                row["within_3_percent_paired"] = all(
                    abs(row[f"{m}_paired_ratio"] - 1) <= 0.03 for m in ("ttft", "tpot")
                )
                # Rank by rank within a round: at several sessions on one CPU core, prefills queue, so
                # TTFT is a request's place in the queue times one prefill, and a p50 between two places
                # jumps when one request changes place. The k-th fastest against the k-th fastest of
                # the same round compares the clients, not the queue lottery.
                for metric in ("ttft", "tpot"):
                    matched = [
                        stats.rank_matched_ratios(
                            pooled[("servegrid", concurrency, "r", r)][metric],
                            pooled[("upstream", concurrency, "r", r)][metric],
                        )
                        for r in range(args.rounds)
                    ]
                    row[f"{metric}_matched_ratio"] = float(np.median(np.concatenate(matched)))
                    row[f"{metric}_matched_ratio_ci"] = stats.grouped_median_ci(matched)
                row["within_3_percent_matched"] = all(
                    abs(row[f"{m}_matched_ratio"] - 1) <= 0.03 for m in ("ttft", "tpot")
                )
                # The noise floor: each client against itself, even rounds over odd rounds.
                row["self_ratio"] = {
                    tool: {
                        metric: float(np.median(pooled[(tool, concurrency, 0)][metric]))
                        / float(np.median(pooled[(tool, concurrency, 1)][metric]))
                        for metric in ("ttft", "tpot")
                    }
                    for tool in ("servegrid", "upstream")
                    if (tool, concurrency, 1) in pooled
                }
                # Every value, per client and round, so that a distribution can be looked at, not only its p50.
                row["values_s"] = {
                    tool: [
                        {m: pooled[(tool, concurrency, "r", r)][m] for m in ("ttft", "tpot")}
                        for r in range(args.rounds)
                    ]
                    for tool in ("servegrid", "upstream")
                }
                rows.append(row)
                print(
                    f"{name:<13} c={concurrency}  n={row['requests_each']}  "
                    f"TTFT p50 {row['ttft_p50_ms']['servegrid']:7.1f} vs {row['ttft_p50_ms']['upstream']:7.1f} ms "
                    f"(x{row['ttft_ratio']:.3f}, {interval(row['ttft_ratio_ci'])})  "
                    f"TPOT p50 {row['tpot_p50_ms']['servegrid']:5.2f} vs {row['tpot_p50_ms']['upstream']:5.2f} ms "
                    f"(x{row['tpot_ratio']:.3f}, {interval(row['tpot_ratio_ci'])})  "
                    f"ITL p50: servegrid per token {row['itl_p50_ms']['servegrid_per_token']:.2f}, per chunk "
                    f"{row['itl_p50_ms']['servegrid_per_chunk']:.2f}; upstream per chunk "
                    f"{row['itl_p50_ms']['upstream_per_chunk']:.2f} ms",
                    flush=True,
                )
                print(f"{'':<13}      paired by round: TTFT x{row['ttft_paired_ratio']:.3f} "
                      f"({interval(row['ttft_paired_ratio_ci'])})  TPOT x{row['tpot_paired_ratio']:.3f} "
                      f"({interval(row['tpot_paired_ratio_ci'])})", flush=True)  # fmt: skip
                print(f"{'':<13}      rank-matched within rounds: TTFT x{row['ttft_matched_ratio']:.3f} "
                      f"({interval(row['ttft_matched_ratio_ci'])})  TPOT x{row['tpot_matched_ratio']:.3f} "
                      f"({interval(row['tpot_matched_ratio_ci'])})", flush=True)  # fmt: skip
                for tool, ratios in row["self_ratio"].items():
                    print(f"{'':<13}      noise floor, {tool} against itself (even/odd rounds): "
                          f"TTFT x{ratios['ttft']:.3f}  TPOT x{ratios['tpot']:.3f}", flush=True)  # fmt: skip
    finally:
        server.stop_all(runtime, reason="comparison ended")
    (args.out / "upstream_compare.json").write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {args.out / 'upstream_compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
