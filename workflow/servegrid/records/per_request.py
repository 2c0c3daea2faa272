"""Per-request figures: the formulas every stage reads a request by (the cell's sampling, the summary, the figures).

Times come from the client's monotonic clock:
- ``ttft_s`` = arrival of the first token-carrying chunk − send time
- ``e2e_s`` = stream end − send time
- ``tpot_s`` = (e2e_s − ttft_s) / (output tokens − 1)
- ``decode_tps`` = (output tokens − 1) / (e2e_s − ttft_s), decode speed seen by one session
- ``send_delay_s`` = send time − intended send time (client-side queueing)
- per-token ITL: each chunk after the first contributes ``tokens`` values of
  gap / tokens, where gap is the time since the previous chunk
- ``chunk_gap``: the raw gaps between chunks (upstream's "ITL")
A request is valid when it has no error and the server reported exactly the
prompt and output token counts that were requested.

They sit beside the request record, below the measured phase and the summary alike, so that a cell counts
its samples exactly as the summary will report them without either importing the other.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

# The per-request columns whose percentiles the summary reports.
PER_REQUEST = ("ttft_s", "tpot_s", "e2e_s", "decode_tps", "send_delay_s", "ttft_from_intended_s", "e2e_from_intended_s")


def derive(df: pd.DataFrame) -> pd.DataFrame:
    """Add the per-request figures named in the module docstring."""
    out = df.copy()
    out["ttft_s"] = [t[0] if t is not None and len(t) else np.nan for t in out["chunk_times_s"]]
    out["e2e_s"] = out["end_s"] - out["sent_s"]
    decode_time = out["e2e_s"] - out["ttft_s"]
    steps = out["output_tokens_reported"].astype("float64") - 1
    out["tpot_s"] = np.where(steps > 0, decode_time / steps, np.nan)
    out["decode_tps"] = np.where((steps > 0) & (decode_time > 0), steps / decode_time, np.nan)
    out["send_delay_s"] = out["sent_s"] - out["intended_send_s"]
    # Latency as the user who wanted to send at the intended time saw it (no coordinated omission).
    out["ttft_from_intended_s"] = out["ttft_s"] + out["send_delay_s"]
    out["e2e_from_intended_s"] = out["e2e_s"] + out["send_delay_s"]
    out["tokens_per_chunk"] = [float(np.mean(t)) if t is not None and len(t) else np.nan for t in out["chunk_tokens"]]
    out["prompt_tokens_ok"] = out["prompt_tokens_reported"] == out["prompt_tokens_requested"]
    out["output_tokens_ok"] = out["output_tokens_reported"] == out["output_tokens_requested"]
    out["valid"] = out["error"].isna() & out["prompt_tokens_ok"] & out["output_tokens_ok"]
    return out


def per_token_itl(chunk_times: np.ndarray, chunk_tokens: np.ndarray) -> np.ndarray:
    times = np.asarray(chunk_times, dtype=float)
    tokens = np.asarray(chunk_tokens, dtype=float)
    if times.size < 2:
        return np.empty(0)
    gaps = np.diff(times)
    return np.repeat(gaps / tokens[1:], tokens[1:].astype(int))
