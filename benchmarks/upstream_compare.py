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

Reported per configuration and concurrency, as servegrid / upstream with 95%
bootstrap intervals:
- TTFT p50 and TPOT p50 over all requests, and the median of the per-round
  ratios (the server's speed drifts from round to round on a shared machine;
  within a round both clients see the same server);
- rank-matched: the k-th fastest request of a round against the k-th fastest
  of the same round. At several sessions on one CPU core prefills queue, and
  TTFT is a request's place in the queue times one prefill; a p50 that falls
  between two places jumps when one request changes place;
- over the server's own timing: each client's mean over vLLM's mean
  (its TTFT and TPOT histograms) for the very requests of its turn. The queue
  lottery and the drift reach the server's figure too and cancel; what is left
  is how the clients measure;
- servegrid's per-token ITL beside the per-chunk gaps that upstream calls ITL.

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
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from servegrid import engines
from servegrid.config import Experiment
from servegrid.engines import metrics
from servegrid.measuring.client import Streamer, streaming_session
from servegrid.measuring.client_monitor import CollectorPause
from servegrid.measuring.measured_phase import run_loop
from servegrid.modes.prompts import PromptBuilder
from servegrid.records import per_request
from servegrid.records.request import RequestRecord
from servegrid.serving import procs, server, tiny_model
from servegrid.stats import intervals
from servegrid.testing import benchmark_stats

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROMPT_TOKENS, OUTPUT_TOKENS = 1024, 128
ENGINE = engines.get("vllm")  # `vllm bench serve` is vLLM's own client: the comparison is on vLLM only
# What `vllm bench serve` puts in a request itself; the rest of servegrid's request goes in its --extra-body.
UPSTREAM_SETS = ("model", "prompt", "max_tokens", "temperature", "stream")


def servegrid_request(served: str, prompt: str) -> dict:
    """A cell's request, with the text both clients send in place of token ids (upstream sends text)."""
    return {**ENGINE.completion_payload(served, [], OUTPUT_TOKENS, 0.0), "prompt": prompt}


def upstream_extra_body() -> dict:
    return {k: v for k, v in servegrid_request("", "").items() if k not in UPSTREAM_SETS}


def experiment(out: Path, config: Path | None, vllm_python: Path) -> Experiment:
    """The config's experiment as it is; without one, the CPU demo's, with its tiny model built under ``out``."""
    if config is not None:
        return Experiment.from_file(config)
    raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw["model"]["path"] = str(out / "model")
    raw["engine"]["command"][0] = str(vllm_python)
    raw["engine"]["args"] = ["--load-format", "dummy", "--max-model-len", "4096"]
    exp = Experiment(raw, source="upstream_compare")
    tiny_model.build(out / "model", tiny_model.TinyModelSpec(**exp.tiny_model_spec()))
    return exp


def client_cores(exp: Experiment) -> set[int]:
    """The demo's client core (operations.client_cpus, away from the server's); else the last CPU."""
    return set(exp.operations.client_cpus or [sorted(os.sched_getaffinity(0))[-1]])


class SharedServer:
    """The vLLM server both clients take turns on: its prompts, its prefix cache and its own timing.

    Prompts are cold, 1024 tokens, as text, cut from a corpus its tokenizer reads once.
    """

    def __init__(self, url: str, served: str) -> None:
        self.url, self.served = url, served
        self.http = httpx.Client(timeout=300)
        self.builder = PromptBuilder(self.tokenize, seed=11, corpus_tokens=8192)

    def tokenize(self, text: str) -> list[int]:
        return ENGINE.tokenize(self.http, self.url, self.served, text)

    def texts(self, count: int, label: str) -> list[str]:
        """``count`` prompts that no earlier one starts like (what both clients send)."""
        ids = [self.builder.unique(PROMPT_TOKENS, f"{label} {i}") for i in range(count)]
        return [ENGINE.detokenize(self.http, self.url, self.served, t) for t in ids]

    def warm_and_reset(self, label: str) -> None:
        """Empty the prefix cache, then one unmeasured request, so that each client's turn starts alike."""
        ENGINE.reset_prefix_cache(self.http, self.url)
        body = {"model": self.served, "prompt": self.texts(1, f"warm {label}")[0], "max_tokens": 8}
        self.http.post(f"{self.url}{ENGINE.completions_path}", json=body).raise_for_status()

    def counters(self) -> dict[str, float]:
        """vLLM's counters as they stand now, its own TTFT and TPOT timing among them."""
        exposition = self.http.get(f"{self.url}{ENGINE.metrics_path}").raise_for_status().text
        return ENGINE.parse_metrics(exposition, self.served)

    def close(self) -> None:
        self.http.close()


async def servegrid_client(url: str, served: str, prompts: list[str], concurrency: int) -> list[RequestRecord]:
    """Closed loop, the way a decode cell runs: connections opened and the cyclic GC paused before the
    measured requests, streams decoded after them; session s sends prompts s, s+c, s+2c, ..."""
    async with streaming_session(concurrency + 2, 600) as session:
        streamer = Streamer(session, url)
        done: list[RequestRecord] = []

        async def closed_loop(s: int) -> None:
            for i in range(s, len(prompts), concurrency):
                record = RequestRecord(f"p{i}", s, i, "measured", 1, PROMPT_TOKENS, OUTPUT_TOKENS)
                record.intended_send_ns = record.t0_ns = time.monotonic_ns()
                payload = servegrid_request(served, prompts[i])
                await streamer.stream(ENGINE.completions_path, payload, record, decode=False)
                done.append(record)

        await streamer.open_connections(concurrency, ENGINE.health_path)
        collector = CollectorPause()
        collector.start()
        try:
            await asyncio.gather(*(closed_loop(s) for s in range(concurrency)))
        finally:
            collector.stop()
        streamer.decode_pending()
    return done


def servegrid_run(url: str, served: str, prompts: list[str], concurrency: int) -> dict[str, list[float]]:
    frame = per_request.derive(
        benchmark_stats.records_frame(run_loop(servegrid_client(url, served, prompts, concurrency)))
    )
    frame = frame[frame["error"].isna()]
    itl = [per_request.per_token_itl(t, k) for t, k in zip(frame["chunk_times_s"], frame["chunk_tokens"], strict=True)]
    gaps = [np.diff(np.asarray(t, dtype=float)) for t in frame["chunk_times_s"]]
    return {
        "ttft": frame["ttft_s"].tolist(),
        "tpot": frame["tpot_s"].tolist(),
        "itl_token": np.concatenate(itl).tolist() if itl else [],
        "chunk_gap": np.concatenate(gaps).tolist() if gaps else [],
    }


def upstream_run(
    url: str, served: str, tokenizer: str, prompts: list[str], concurrency: int, out: Path, vllm_python: Path
) -> dict[str, list[float]]:
    stamp = time.monotonic_ns()
    dataset = out / f"prompts-{stamp}.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result = out / f"upstream-{stamp}.json"
    done = subprocess.run(
        [
            str(vllm_python),
            str(REPO / "benchmarks" / "upstream_bench.py"),
            "--backend",
            "vllm",
            "--base-url",
            url,
            "--model",
            served,
            "--tokenizer",
            tokenizer,
            "--dataset-name",
            "custom",
            "--dataset-path",
            str(dataset),
            "--custom-output-len",
            str(OUTPUT_TOKENS),
            "--skip-chat-template",
            "--no-oversample",
            "--num-prompts",
            str(len(prompts)),
            "--max-concurrency",
            str(concurrency),
            "--ignore-eos",
            "--temperature",
            "0",
            "--num-warmups",
            "0",
            "--extra-body",
            json.dumps(upstream_extra_body()),
            "--disable-tqdm",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(out),
            "--result-filename",
            result.name,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=1200,  # on our client core: inherited
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
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


def pooled(rounds: list[dict[str, list[float]]], metric: str) -> list[float]:
    return [value for run in rounds for value in run[metric]]


def compare(name: str, concurrency: int, ours: list[dict], theirs: list[dict]) -> dict:
    """servegrid against upstream for one configuration and concurrency; ``ours``/``theirs``: one run per round."""
    p50 = lambda values: float(np.median(values)) * 1e3  # noqa: E731 - ms
    clients = (("servegrid", ours), ("upstream", theirs))
    row: dict = {"configuration": name, "concurrency": concurrency, "requests_each": len(pooled(ours, "ttft"))}
    for metric in ("ttft", "tpot"):
        a, b = pooled(ours, metric), pooled(theirs, metric)
        row[f"{metric}_p50_ms"] = {"servegrid": p50(a), "upstream": p50(b)}
        row[f"{metric}_ratio"] = p50(a) / p50(b)
        row[f"{metric}_ratio_ci"] = intervals.ratio_of_medians_ci(a, b)
        # Paired by round: the server drifts between rounds, both clients see each round's state.
        per_round = [p50(x[metric]) / p50(y[metric]) for x, y in zip(ours, theirs, strict=True)]
        row[f"{metric}_paired_ratio"] = float(np.median(per_round))
        row[f"{metric}_paired_ratio_ci"] = intervals.median_ci(per_round)
        # Rank by rank within a round: at several sessions on one CPU core, prefills queue, so TTFT is a
        # request's place in the queue times one prefill, and a p50 between two places jumps when one
        # request changes place. The k-th fastest against the k-th fastest of the same round compares the
        # clients, not the queue lottery.
        matched = [benchmark_stats.rank_matched_ratios(x[metric], y[metric]) for x, y in zip(ours, theirs, strict=True)]
        row[f"{metric}_matched_ratio"] = float(np.median(np.concatenate(matched)))
        row[f"{metric}_matched_ratio_ci"] = benchmark_stats.grouped_median_ci(matched)
    # Against the server's own timing of the very requests each client sent (vLLM's histograms): each
    # client's mean over the server's mean in its turn, then servegrid's over upstream's. What the queue
    # lottery and the server's drift do to a turn, the server's figure sees too, so it cancels; what is
    # left is how the two clients measure. Only where the server timed exactly the requests the client did.
    server_timed = all(
        run["server"]["ttft"] and run["server"]["tpot"] and run["server"]["requests"] == len(run["ttft"])
        for run in ours + theirs
    )
    for metric in ("ttft", "tpot"):
        if not server_timed:
            row[f"{metric}_server_normalized_ratio"], row[f"{metric}_server_normalized_ratio_ci"] = None, (None, None)
            continue
        over_server = {
            tool: [float(np.mean(run[metric])) / run["server"][metric] for run in runs] for tool, runs in clients
        }
        normalized = [a / b for a, b in zip(over_server["servegrid"], over_server["upstream"], strict=True)]
        row[f"{metric}_server_normalized_ratio"] = float(np.median(normalized))
        row[f"{metric}_server_normalized_ratio_ci"] = intervals.median_ci(normalized)
        row[f"{metric}_client_over_server"] = {tool: float(np.median(v)) for tool, v in over_server.items()}
        row[f"{metric}_client_minus_server_ms"] = {
            tool: float(np.median([(np.mean(run[metric]) - run["server"][metric]) * 1e3 for run in runs]))
            for tool, runs in clients
        }
    row["itl_p50_ms"] = {
        "servegrid_per_token": p50(pooled(ours, "itl_token")),
        "servegrid_per_chunk": p50(pooled(ours, "chunk_gap")),
        "upstream_per_chunk": p50(pooled(theirs, "chunk_gap")),
    }
    for way in ("", "_paired", "_matched", "_server_normalized"):
        ratios = [row[f"{m}{way}_ratio"] for m in ("ttft", "tpot")]
        row[f"within_3_percent{way}"] = None if None in ratios else all(abs(r - 1) <= 0.03 for r in ratios)
    # The noise floor: each client against itself, even rounds over odd rounds.
    if len(ours) > 1:
        row["self_ratio"] = {
            tool: {m: p50(pooled(runs[0::2], m)) / p50(pooled(runs[1::2], m)) for m in ("ttft", "tpot")}
            for tool, runs in clients
        }
    # Every value, per client and round, so that a distribution can be looked at, not only its p50.
    row["values_s"] = {tool: [{m: run[m] for m in ("ttft", "tpot")} for run in runs] for tool, runs in clients}
    return row


def print_row(row: dict) -> None:
    ms = row["ttft_p50_ms"]

    def ratio(metric: str, way: str = "") -> str:
        return f"x{row[f'{metric}{way}_ratio']:.3f}, {interval(row[f'{metric}{way}_ratio_ci'])}"

    itl = row["itl_p50_ms"]
    print(
        f"{row['configuration']:<13} c={row['concurrency']}  n={row['requests_each']}  "
        f"TTFT p50 {ms['servegrid']:7.1f} vs {ms['upstream']:7.1f} ms ({ratio('ttft')})  "
        f"TPOT p50 {row['tpot_p50_ms']['servegrid']:5.2f} vs {row['tpot_p50_ms']['upstream']:5.2f} ms "
        f"({ratio('tpot')})  ITL p50: servegrid per token {itl['servegrid_per_token']:.2f}, per chunk "
        f"{itl['servegrid_per_chunk']:.2f}; upstream per chunk {itl['upstream_per_chunk']:.2f} ms",
        flush=True,
    )
    for label, way in (
        ("paired by round", "_paired"),
        ("rank-matched within rounds", "_matched"),
        ("each over the server's own timing", "_server_normalized"),
    ):
        if row[f"ttft{way}_ratio"] is not None:
            print(f"{'':<19}{label}: TTFT {ratio('ttft', way)}  TPOT {ratio('tpot', way)}", flush=True)
    if row["ttft_server_normalized_ratio"] is not None:
        above = {m: row[f"{m}_client_minus_server_ms"] for m in ("ttft", "tpot")}
        print(
            f"{'':<19}client mean minus the server's: TTFT servegrid {above['ttft']['servegrid']:+.2f} ms, "
            f"upstream {above['ttft']['upstream']:+.2f} ms;  TPOT servegrid {above['tpot']['servegrid']:+.3f} ms, "
            f"upstream {above['tpot']['upstream']:+.3f} ms",
            flush=True,
        )
    for tool, ratios in row.get("self_ratio", {}).items():
        print(
            f"{'':<19}noise floor, {tool} against itself (even/odd rounds): "
            f"TTFT x{ratios['ttft']:.3f}  TPOT x{ratios['tpot']:.3f}",
            flush=True,
        )


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
    if exp.engine.kind != ENGINE.kind:
        parser.error(f"--config: engine.kind is '{exp.engine.kind}'; `vllm bench serve` compares on vLLM only")
    tokenizer = exp.model.path
    # The config's own runtime and placement, but ports and state of its own, apart from the pipeline's.
    own = {"port_range": (8400, 8499), "state_dir": str(args.out / "state"), "cwd": str(REPO)}
    runtime = dataclasses.replace(server.Runtime.from_config(exp.operations), **own)
    owner = procs.ProcessRef.of(os.getpid())
    served = exp.model.served_name
    all_cpus = os.sched_getaffinity(0)
    rows = []
    try:
        for name in args.configurations or exp.configurations:
            os.sched_setaffinity(0, all_cpus)  # the server, our child, gets the demo's server cores
            placed = dataclasses.replace(server.Runtime.from_config(exp.operations, exp.configurations[name]), **own)
            facts = server.ensure(exp.launch_spec(name), placed, owner)
            os.sched_setaffinity(0, client_cores(exp))
            runs: dict[tuple[str, int], list[dict[str, list[float]]]] = {}
            source = SharedServer(facts.url, served)
            for round_ in range(args.rounds):
                for concurrency in args.concurrency:
                    prompts = source.texts(args.requests, f"{name} r{round_} c{concurrency}")
                    order = ("servegrid", "upstream") if round_ % 2 == 0 else ("upstream", "servegrid")
                    for tool in order:
                        source.warm_and_reset(f"{tool} r{round_} c{concurrency}")
                        before = source.counters()
                        run = (
                            servegrid_run(facts.url, served, prompts, concurrency)
                            if tool == "servegrid"
                            else upstream_run(
                                facts.url, served, tokenizer, prompts, concurrency, args.out, args.vllm_python
                            )
                        )
                        counted = metrics.delta(before, source.counters())
                        server_view = metrics.derived(counted)
                        run["server"] = {figure: server_view[f"{figure}_mean_s"] for figure in metrics.SERVER_TIMING}
                        run["server"]["requests"] = counted["time_to_first_token_seconds_count"]
                        runs.setdefault((tool, concurrency), []).append(run)
            source.close()
            server.stop(name, placed, reason="comparison done")
            for concurrency in args.concurrency:
                rows.append(
                    compare(name, concurrency, runs[("servegrid", concurrency)], runs[("upstream", concurrency)])
                )
                print_row(rows[-1])
    finally:
        server.stop_all(runtime, reason="comparison ended")
    (args.out / "upstream_compare.json").write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {args.out / 'upstream_compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
