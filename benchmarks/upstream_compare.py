"""servegrid's client side by side with `vllm bench serve`, against the same vLLM CPU server.

For each configuration of the CPU demo (prefix caching; ngram speculation) one
real vLLM server is started; then, interleaved and repeated, both clients run
the same workload: random 1024-token prompts, exactly 128 output tokens
(ignore_eos), temperature 0, at concurrency 1 and 4. Reported: TTFT p50 and
TPOT p50 of each client and their ratio (servegrid / upstream), plus
servegrid's per-token ITL next to upstream's per-chunk "ITL".

    .venv/bin/python benchmarks/upstream_compare.py [--rounds 3] [--requests 8] [--out benchmarks/out]

Target (issue 6): ratios within ±3% on TTFT and TPOT.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from servegrid import aggregate, model, procs, records, server
from servegrid.cell import measure, run_loop
from servegrid.config import Experiment

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def experiment(out: Path) -> Experiment:
    raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw["model"]["path"] = str(out / "model")
    raw["engine"]["command"][0] = str(VLLM_PYTHON)
    raw["engine"]["args"] = ["--load-format", "dummy", "--max-model-len", "4096"]
    return Experiment(raw, source="upstream_compare")


def servegrid_run(facts: server.ServerFacts, served: str, concurrency: int, requests: int) -> dict[str, list[float]]:
    settings = {
        "mode": "decode",
        "context": 1024,
        "concurrency": concurrency,
        "sampling": {"temperature": 0.0},
        "workload": {"output_tokens": 128, "requests_per_session": max(1, requests // concurrency),
                     "warmup_requests": 1, "seed": 7, "repeats": 1, "duration_s": None},
    }  # fmt: skip
    operations = {"request_timeout_s": 600, "metrics_interval_s": 1.0}
    rows, _meta = run_loop(measure(settings, facts.url, served, operations))
    frame = aggregate.derive(records.to_frame(rows))
    frame = frame[(frame["phase"] == "measured") & frame["valid"]]
    itl = [aggregate.per_token_itl(t, k) for t, k in zip(frame["chunk_times_s"], frame["chunk_tokens"], strict=True)]
    gaps = [np.diff(np.asarray(t, dtype=float)) for t in frame["chunk_times_s"]]
    return {
        "ttft": frame["ttft_s"].tolist(),
        "tpot": frame["tpot_s"].tolist(),
        "itl_token": np.concatenate(itl).tolist() if itl else [],
        "chunk_gap": np.concatenate(gaps).tolist() if gaps else [],
    }


def upstream_run(facts: server.ServerFacts, served: str, model_dir: Path, concurrency: int, requests: int,
                 out: Path) -> dict[str, list[float]]:  # fmt: skip
    result = out / f"upstream-{facts.configuration}-c{concurrency}-{time.monotonic_ns()}.json"
    subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "benchmarks" / "upstream_bench.py"), "--backend", "vllm",
         "--base-url", facts.url, "--model", served, "--tokenizer", str(model_dir), "--dataset-name", "random",
         "--random-input-len", "1024", "--random-output-len", "128", "--num-prompts", str(requests),
         "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--num-warmups", "1",
         "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name],
        check=True, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    data = json.loads(result.read_text())
    result.unlink()
    ttfts = [t for t in data["ttfts"] if t]
    tpots = [
        (sum(itl)) / (n - 1) for itl, n in zip(data["itls"], data["output_lens"], strict=True) if n and n > 1 and itl
    ]
    return {"ttft": ttfts, "tpot": tpots, "chunk_gap": [g for itl in data["itls"] for g in itl]}


def p50(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per configuration")
    parser.add_argument("--requests", type=int, default=8, help="requests per client, round and concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    exp = experiment(args.out)
    model.build(Path(exp.raw["model"]["path"]), model.TinyModelSpec(**exp.tiny_model_spec()))
    runtime = server.Runtime(port_range=(8400, 8499), startup_timeout_s=900, shutdown_timeout_s=20,
                             state_dir=str(args.out / "state"), cwd=str(REPO))  # fmt: skip
    owner = procs.ProcessRef.of(os.getpid())
    served = exp.raw["model"]["served_name"]
    results = []
    try:
        for name in exp.configurations:
            facts = server.ensure(exp.launch_spec(name), runtime, owner)
            pooled: dict[tuple[str, int], dict[str, list[float]]] = {}
            for _round in range(args.rounds):
                for concurrency in args.concurrency:
                    for tool in ("servegrid", "upstream"):  # interleaved: drift hits both alike
                        run = (
                            servegrid_run(facts, served, concurrency, args.requests)
                            if tool == "servegrid"
                            else upstream_run(
                                facts, served, Path(exp.raw["model"]["path"]), concurrency, args.requests, args.out
                            )
                        )
                        bucket = pooled.setdefault((tool, concurrency), {})
                        for key, values in run.items():
                            bucket.setdefault(key, []).extend(values)
            server.stop(name, runtime, reason="comparison done")
            for concurrency in args.concurrency:
                ours, theirs = pooled[("servegrid", concurrency)], pooled[("upstream", concurrency)]
                row = {
                    "configuration": name,
                    "concurrency": concurrency,
                    "requests_each": len(ours["ttft"]),
                    "ttft_p50_ms": {"servegrid": p50(ours["ttft"]) * 1e3, "upstream": p50(theirs["ttft"]) * 1e3},
                    "tpot_p50_ms": {"servegrid": p50(ours["tpot"]) * 1e3, "upstream": p50(theirs["tpot"]) * 1e3},
                    "itl_p50_ms": {
                        "servegrid_per_token": p50(ours["itl_token"]) * 1e3,
                        "servegrid_per_chunk": p50(ours["chunk_gap"]) * 1e3,
                        "upstream_per_chunk": p50(theirs["chunk_gap"]) * 1e3,
                    },
                }
                row["ttft_ratio"] = row["ttft_p50_ms"]["servegrid"] / row["ttft_p50_ms"]["upstream"]
                row["tpot_ratio"] = row["tpot_p50_ms"]["servegrid"] / row["tpot_p50_ms"]["upstream"]
                row["within_3_percent"] = abs(row["ttft_ratio"] - 1) <= 0.03 and abs(row["tpot_ratio"] - 1) <= 0.03
                results.append(row)
                print(
                    f"{name:<13} c={concurrency}  TTFT p50 {row['ttft_p50_ms']['servegrid']:8.1f} vs "
                    f"{row['ttft_p50_ms']['upstream']:8.1f} ms (x{row['ttft_ratio']:.3f})  TPOT p50 "
                    f"{row['tpot_p50_ms']['servegrid']:6.2f} vs {row['tpot_p50_ms']['upstream']:6.2f} ms "
                    f"(x{row['tpot_ratio']:.3f})  ITL p50 per token {row['itl_p50_ms']['servegrid_per_token']:.2f} / "
                    f"per chunk {row['itl_p50_ms']['servegrid_per_chunk']:.2f} (upstream per chunk "
                    f"{row['itl_p50_ms']['upstream_per_chunk']:.2f}) ms",
                    flush=True,
                )
    finally:
        server.stop_all(runtime, reason="comparison ended")
    (args.out / "upstream_compare.json").write_text(json.dumps({"rows": results}, indent=2))
    print(f"wrote {args.out / 'upstream_compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
