"""What a vLLM server's log says: its KV-cache capacity at start-up, and its engine's death in one line.

vLLM 0.32 prefixes every line of its processes with ``(Worker pid=N) ERROR 12-05 05:21:22 [file.py:1063]``.
When a worker raises while executing a step, the worker prints the traceback, the engine core says
"EngineCore encountered a fatal error" with its own (re-raised) traceback, and the API server answers the
request with HTTP 500 ("EngineCore encountered an issue") and exits (``EngineDeadError``). The first traceback
is the root cause; the later ones wrap it. A server killed from outside (SIGKILL, the OOM killer) or stopped
(SIGSTOP) prints none of this.
"""

from __future__ import annotations

import re

from servegrid.engines.base import StartupFacts

KV_TOKENS_RE = re.compile(r"(?:GPU|CPU|XPU|TPU)? ?KV cache size: ([\d,]+) tokens")
MAX_CONCURRENCY_RE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")

# Either marker: the engine core died of an exception of its own (vllm/v1/engine/core.py, async_llm.py).
DEATH_MARKERS = ("EngineCore encountered a fatal error", "EngineDeadError")
_PREFIX = re.compile(r"^\((?:[\w ]+) pid=\d+\) (?:ERROR|WARNING|INFO|DEBUG|CRITICAL) [\d-]+ [\d:]+ \[[^\]]*\] ?")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def startup_facts(log_text: str) -> StartupFacts:
    """The KV-cache pool in tokens and the concurrency it allows at full length, as the start-up log says."""
    kv = KV_TOKENS_RE.search(log_text)
    conc = MAX_CONCURRENCY_RE.search(log_text)
    return StartupFacts(
        kv_cache_tokens=int(kv.group(1).replace(",", "")) if kv else None,
        max_concurrency=float(conc.group(2)) if conc else None,
    )


def engine_death(log_text: str) -> str | None:
    """The root cause of the engine's death (``TypeError: ... (vllm/v1/worker/mamba_utils.py, line 1226, in
    run_fused_precopy)``), or None where the log shows no death of the engine's own."""
    if not any(marker in log_text for marker in DEATH_MARKERS):
        return None
    lines = [_PREFIX.sub("", line) for line in log_text.splitlines()]
    try:
        start = lines.index("Traceback (most recent call last):")
    except ValueError:
        return "the engine core died (no traceback in the log)"
    where = None
    for line in lines[start + 1 :]:
        frame = _FRAME.match(line)
        if frame:
            path = frame["path"]
            if "/vllm/" in path:  # the innermost of vLLM's own frames: where vLLM met the error
                where = f"vllm/{path.rsplit('/vllm/', 1)[1]}, line {frame['line']}, in {frame['func']}"
            continue
        if line and not line[0].isspace():  # the exception's own line ends the traceback
            return f"{line.strip()} ({where})" if where else line.strip()
    return "the engine core died (its traceback is cut short in the log)"
