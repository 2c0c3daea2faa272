"""What a vLLM server's log says: its KV-cache capacity at start-up, and its engine's death in one line.

vLLM 0.32 prefixes every line of its processes with ``(Worker pid=N) ERROR 12-05 05:21:22 [file.py:1063]``.
When a worker raises while executing a step, the worker prints the traceback, the engine core says
"EngineCore encountered a fatal error" with its own (re-raised) traceback, and the API server answers the
request with HTTP 500 ("EngineCore encountered an issue") and exits (``EngineDeadError``). Where the model runs in
the engine core's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the tests run it), there is no worker: the
engine core's "fatal error" line comes first and its own traceback, right after it, is the root cause
(tests/data/vllm_0_32_engine_death_in_process.log). With workers, the engine core's traceback only wraps the
worker's ("please check the stack trace above for the root cause"): the root cause is then the last traceback
before the fatal-error line (an earlier one is something the engine lived through). An engine core killed from
outside (the OOM killer, SIGKILL) leaves only the API server's ``EngineDeadError`` and "engine core exited
unexpectedly"; a whole server killed or stopped (SIGSTOP) prints none of this.
"""

from __future__ import annotations

import re

from servegrid.engines.base import EngineDeath, StartupFacts

KV_TOKENS_RE = re.compile(r"(?:GPU|CPU|XPU|TPU)? ?KV cache size: ([\d,]+) tokens")
MAX_CONCURRENCY_RE = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
# Logged by the engine core only where the KV cache has several groups (a hybrid model, sliding-window layers):
# "kv cache group sizes (384, 384)" (vLLM 0.32 v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes).
KV_GROUP_SIZES_RE = re.compile(r"kv cache group sizes \(([\d, ]+?),?\)")

# Either marker: the engine core died of an exception of its own (vllm/v1/engine/core.py, async_llm.py).
DEATH_MARKERS = ("EngineCore encountered a fatal error", "EngineDeadError")
# A death of the moment, not of the configuration (issue 42: an OOM at start-up once made every cell of its
# configuration "refused"): memory, the device, its driver or interconnect. Matched in the root cause's line.
_TRANSIENT_CAUSE = re.compile(r"OutOfMemoryError|out of memory|CUDA error|cudaError|CUDA driver|NCCL|\bXid\b", re.I)
# ... or a process of the engine that ended without a word of its own: killed from outside. Matched anywhere.
_KILLED = re.compile(r"died unexpectedly|exited unexpectedly|^Killed$|SIGKILL", re.M)
_TRACEBACK = "Traceback (most recent call last):"
_PREFIX = re.compile(r"^\((?:[\w ]+) pid=\d+\) (?:ERROR|WARNING|INFO|DEBUG|CRITICAL) [\d-]+ [\d:]+ \[[^\]]*\] ?")
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def startup_facts(log_text: str) -> StartupFacts:
    """The KV-cache pool in tokens, the concurrency it allows at full length and, where the cache has several
    groups, each group's block size, as the start-up log says."""
    kv = KV_TOKENS_RE.search(log_text)
    conc = MAX_CONCURRENCY_RE.search(log_text)
    groups = KV_GROUP_SIZES_RE.search(log_text)
    return StartupFacts(
        kv_cache_tokens=int(kv.group(1).replace(",", "")) if kv else None,
        max_concurrency=float(conc.group(2)) if conc else None,
        kv_group_block_sizes=tuple(int(size) for size in groups.group(1).split(",")) if groups else None,
    )


def engine_death(log_text: str) -> EngineDeath | None:
    """The engine's death as the log tells it: its root cause (``TypeError: ... (vllm/v1/worker/mamba_utils.py,
    line 1226, in run_fused_precopy)``) and whether it is a fault of the moment; None where the log shows no death
    of the engine."""
    lines = [_PREFIX.sub("", line) for line in log_text.splitlines()]
    marker = next((i for i, line in enumerate(lines) if any(m in line for m in DEATH_MARKERS)), None)
    if marker is None:
        return None
    killed = bool(_KILLED.search("\n".join(lines)))
    cause = None
    if DEATH_MARKERS[0] in lines[marker] and lines[marker + 1 : marker + 2] == [_TRACEBACK]:
        own = _traceback_cause(lines[marker + 2 :])  # the engine core's own traceback, right after its word
        if own is not None and not _wraps(own):
            cause = own
    starts = [i for i, line in enumerate(lines[: marker + 1]) if line == _TRACEBACK]
    if cause is None and starts:
        cause = _traceback_cause(lines[starts[-1] + 1 :])
        if cause is None:  # not known to be the configuration's: not a refusal
            return EngineDeath("the engine core died (its traceback is cut short in the log)", True)
    if cause is None or _wraps(cause):  # only the API server's word that its engine is gone
        return EngineDeath("the engine core died without a root cause in the log (killed from outside?)", True)
    return EngineDeath(cause, killed or bool(_TRANSIENT_CAUSE.search(cause)))


def _wraps(cause: str) -> bool:
    """Whether an exception only points at another: vLLM's re-raise of a worker's error, or the API server's word
    that its engine is gone."""
    return "stack trace above" in cause or "See stack trace" in cause or any(m in cause for m in DEATH_MARKERS)


def _traceback_cause(lines: list[str]) -> str | None:
    """The exception line ending the traceback whose frames ``lines`` start with, and the innermost of vLLM's
    own frames (where vLLM met the error); None when the log cuts it short."""
    where = None
    for line in lines:
        frame = _FRAME.match(line)
        if frame:
            path = frame["path"]
            if "/vllm/" in path:
                where = f"vllm/{path.rsplit('/vllm/', 1)[1]}, line {frame['line']}, in {frame['func']}"
            continue
        if line and not line[0].isspace():  # the exception's own line ends the traceback
            return f"{line.strip()} ({where})" if where else line.strip()
    return None
