"""What makes a cell invalid beyond its own requests: the client's watch of its own timing (event-loop lag, CPU,
slipped sends), someone else's requests on the server, the GPUs' watch (another process on them), and the reasons,
in words, the summary's ``invalid_reasons`` gives (:mod:`servegrid.analysis.summary_table` builds the row)."""

from __future__ import annotations

from typing import Any

from servegrid.analysis.cell_rows import CellRows
from servegrid.config import Validity
from servegrid.engines import metrics
from servegrid.records.cell_record import CellRecord
from servegrid.stats import intervals


def client_columns(rows: CellRows, meta: CellRecord, validity: Validity) -> tuple[dict[str, Any], float | None]:
    """What the client's own watch saw, and whether it kept its schedule; with the sends' raw p99 delay."""
    client = meta.client or {}
    out: dict[str, Any] = {
        "client_loop_lag_p99_s": client.get("loop_lag_p99_s"),
        "client_loop_lag_max_s": client.get("loop_lag_max_s"),
        "client_cpu_fraction": client.get("cpu_fraction"),
        "client_cpus": ",".join(str(c) for c in client.get("cpus") or []),
    }
    # Someone else's requests on the server during the cell: first tokens the server counted beyond every request
    # of ours it could have counted (None: a cell file from before the client counted them).
    sent, counted = (
        client.get("requests_in_window"),
        (meta.server_metrics or {}).get("delta", {}).get(f"{metrics.SERVER_TIMING['ttft']}_count"),
    )
    out["foreign_requests"] = None if sent is None or counted is None else max(0, int(counted) - int(sent))
    # A check, not a figure: judged on the raw p99 from any number of requests (the reported column is only
    # filled from 300 on), since a few late sends already mean the client did not keep its schedule.
    send_delay = intervals.percentiles(rows.floats("send_delay_s", rows.valid), (99,), enough_only=False)["p99"]
    out["sends_slipped"] = bool((send_delay or 0) > validity.max_send_delay_s)
    out["client_bottleneck"] = bool(
        (out["client_loop_lag_p99_s"] or 0) > validity.max_loop_lag_s
        or (out["client_cpu_fraction"] or 0) >= validity.max_client_cpu
    )
    return out, send_delay


def gpu_columns(meta: CellRecord) -> dict[str, Any]:
    """Which GPUs served the cell and how they ran during its stages (NVML; servegrid.measuring.gpu_watch): every
    column None where not measured (no NVIDIA driver, or a cell file from before), and the reason said."""
    watched = meta.gpus or {"measured": False, "why": "a cell file from before GPUs were watched"}
    if not watched.get("measured"):
        columns = ("gpu_devices", "gpu_sm_clock_mhz_min", "gpu_sm_clock_mhz_mean", "gpu_sm_clock_max_mhz")
        return (
            dict.fromkeys(columns)
            | dict.fromkeys(ENERGY_COLUMNS)
            | {
                "gpu_clock_held_back": None,
                "gpu_foreign_processes": None,
                "gpu_not_measured": watched.get("why") or "not measured",
            }
        )
    devices = watched.get("devices") or []
    return {
        "gpu_devices": "; ".join(f"{d['index']}: {d['name']} ({d['uuid']})" for d in devices),
        "gpu_sm_clock_mhz_min": watched.get("sm_clock_mhz_min"),
        "gpu_sm_clock_mhz_mean": watched.get("sm_clock_mhz_mean"),
        "gpu_sm_clock_max_mhz": max((d["sm_clock_max_mhz"] for d in devices), default=None),
        "gpu_clock_held_back": ", ".join(watched.get("held_back") or []),
        "gpu_foreign_processes": len(watched.get("foreign_pids") or []),
        "gpu_not_measured": None,
    } | energy_columns(meta, watched)


ENERGY_COLUMNS = ("gpu_energy_j", "joules_per_output_token", "joules_per_token", "gpu_energy_not_measured")


def energy_columns(meta: CellRecord, watched: dict[str, Any]) -> dict[str, Any]:
    """What this route's stages drew from the GPUs (issue 43), per token the server counted over the measured phase:
    its output tokens, and its prompt and output tokens together (cached prompt tokens included, as vLLM counts
    them). Per route: a cell measured straight and through the gateway has each route's own repeats."""
    drawn = [r.get("gpu_energy_j") for r in meta.repeats]
    if not drawn or any(j is None for j in drawn):
        why = watched.get("energy_why_not") or "a cell file from before the GPUs' energy was read"
        return dict.fromkeys(ENERGY_COLUMNS) | {"gpu_energy_not_measured": why}
    energy = float(sum(float(j) for j in drawn if j is not None))
    delta = (meta.server_metrics or {}).get("delta", {})
    output = delta.get("generation_tokens") or 0
    tokens = output + (delta.get("prompt_tokens") or 0)
    return {
        "gpu_energy_j": energy,
        "joules_per_output_token": energy / output if output else None,
        "joules_per_token": energy / tokens if tokens else None,
        "gpu_energy_not_measured": None,
    }


def invalid_reasons(row: dict[str, Any], send_delay: float | None, validity: Validity) -> list[str]:
    """Why the cell is invalid (none: valid)."""
    reasons = []
    if row["n_requests"] == 0:
        reasons.append("no measured requests")
    if row["n_errors"]:
        reasons.append(f"{row['n_errors']} failed requests")
    if row["n_token_mismatch"]:
        reasons.append(f"{row['n_token_mismatch']} token-count mismatches")
    if row["n_unmeasured_errors"]:
        reasons.append(f"{row['n_unmeasured_errors']} warm-up or probe requests failed")
    if row["cache_contradiction"]:
        reasons.append(
            f"prefix-cache hit rate {row['server_prefix_cache_hit_rate'] or 0:.2f} "
            f"contradicts the expected {row['expected_hit_rate']:.2f}"
        )
    if row["sends_slipped"]:
        reasons.append(
            f"sends slipped: p99 {(send_delay or 0) * 1e3:.1f} ms after they were due "
            f"(limit {validity.max_send_delay_s * 1e3:.1f} ms)"
        )
    if row["foreign_requests"]:
        reasons.append(
            f"the server answered {row['foreign_requests']} requests the client did not send during the cell "
            "(another client's traffic)"
        )
    if row["gpu_foreign_processes"]:
        reasons.append(
            f"{row['gpu_foreign_processes']} other process(es) ran on the server's GPUs during the cell (NVML)"
        )
    if row["client_bottleneck"]:
        lag, cpu = row["client_loop_lag_p99_s"] or 0, row["client_cpu_fraction"] or 0
        reasons.append(f"the client was the bottleneck: event-loop lag p99 {lag * 1e3:.1f} ms, CPU {cpu:.0%} of a core")
    return reasons
