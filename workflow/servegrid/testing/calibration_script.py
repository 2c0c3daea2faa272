"""What the calibration server is told to do and what it counts (:mod:`servegrid.testing.calibration`): the script of
one server's timing and faults, its counters, and the whitespace vocabulary it tokenizes with."""

import zlib
from dataclasses import dataclass, field

from servegrid import text
from servegrid.testing import dialect as calibration_dialect

# What ``Script.faults`` can do to one generation request. Each is something a real server or the
# network between does to a stream, and each must cost the client one failed request, never the cell.
FAULT_KINDS = {
    "reset": "stream two chunks, then reset the TCP connection (RST): the client's read fails mid-stream",
    "500": "answer HTTP 500 with a JSON error body instead of streaming",
    "503": "answer HTTP 503 with a JSON error body instead of streaming (an overloaded server)",
    "not-object": "after the first chunk, one SSE event whose data is JSON but not an object ([1, 2])",
    "null-tokens": "the first chunk's usage.completion_tokens is null: its tokens cannot be timed",
    "engine-death": "print a vLLM engine core's death (a worker's traceback, 'EngineCore encountered a fatal error') "
    "to stderr, answer HTTP 500 as vLLM does, then exit 1: an engine that refuses its configuration",
    "engine-oom": "as engine-death, with torch's CUDA out-of-memory error as the worker's root cause: a death of the "
    "moment (another process took the GPU's memory), not the configuration's",
    "exit-after": "answer the request in full, then exit 1 at the next health check or model list (servegrid asks one "
    "on each connection it opens for a stage): a server lost between two stages (killed, out of memory)",
}

# What a vLLM 0.32 worker and engine core print when a step raises (tests/data/vllm_0_32_engine_death.log, cut).
_WORKER = "(Worker pid=1) ERROR 12-05 05:21:22 [multiproc_executor.py:1063] "
ENGINE_DEATH_LOG = (
    f"{_WORKER}Traceback (most recent call last):\n"
    f'{_WORKER}  File "/venv/site-packages/vllm/v1/worker/calibration.py", line 1, in run_step\n'
    f"{_WORKER}    step[grid]()\n"
    f"{_WORKER}NotImplementedError: the calibration engine was told to refuse this configuration\n"
    "(EngineCore pid=1) ERROR 12-05 05:21:22 [core.py:1512] EngineCore encountered a fatal error.\n"
)
# The same death of torch's CUDA out-of-memory error, in the words torch 2.13 raises it with.
ENGINE_OOM_LOG = ENGINE_DEATH_LOG.replace(
    "NotImplementedError: the calibration engine was told to refuse this configuration",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.",
)


@dataclass
class Script:
    """How the server streams. Times in seconds."""

    ttft_s: float = 0.02
    interval_s: float = 0.005
    tokens_per_chunk: int = 1
    jitter_s: float = 0.0
    seed: int = 0
    # Speculative decoding as the metrics see it: each chunk is one verification step of this many
    # draft tokens, all accepted (its tokens beyond the first), and carries up to this many + 1 tokens.
    speculative_tokens: int = 0
    # Deliberate faults, to provoke the client's validity checks.
    prompt_tokens_offset: int = 0
    completion_tokens_offset: int = 0
    prefix_cache: bool = True
    fail_with_status: int = 0  # answer every generation request with this HTTP status
    legacy_metric_names: bool = False  # the vLLM dialect's names before vLLM 0.11
    context_limit: int = calibration_dialect.CONTEXT_LIMIT  # what /v1/models reports as max_model_len
    stall_from_request: int = 0  # fault: from this request on (1-based), stream one chunk, then hang; 0: never
    # Faults of single requests: {request number (1-based, counted as stall_from_request counts them): a
    # FAULT_KINDS key}. Request 1 is the server's own start-up warm-up, then come the cell's.
    faults: dict[int, str] = field(default_factory=dict)
    # A pause of the whole engine (a long prefill, a preemption storm, a GC pause): {request number: seconds}. From
    # that request's arrival, no stream sends anything for that long; then each goes on where it was.
    freezes: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = {n: kind for n, kind in self.faults.items() if kind not in FAULT_KINDS or n < 1}
        if unknown:
            raise ValueError(f"faults {unknown} (request numbers from 1, kinds: {', '.join(FAULT_KINDS)})")

    @property
    def chunk_tokens(self) -> int:
        return self.speculative_tokens + 1 if self.speculative_tokens else self.tokens_per_chunk


@dataclass
class Counters:
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    running: int = 0
    events: int = 0
    verification_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    late_ns: list[int] = field(default_factory=list)
    seen_blocks: set[int] = field(default_factory=set)
    # Its own timing of each request, as an engine's histograms keep it: seconds summed, requests counted.
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)


class Vocabulary:
    """Whitespace tokens ↔ ids: deterministic, good enough to count and round-trip."""

    def __init__(self) -> None:
        self.words = ["<|endoftext|>", *sorted(set(text.WORDS))]
        self.ids = {w: i for i, w in enumerate(self.words)}

    def encode(self, content: str) -> list[int]:
        return [self._id(w) for w in content.split()]

    def _id(self, word: str) -> int:
        # A word outside the vocabulary (a prompt's nonce) gets an id of its own past the vocabulary, from its
        # CRC-32, written back as "<id>" so that ids round-trip: folded into the vocabulary's 221 ids, two cells'
        # nonces shared an id about once in 220 pairs, and their "fresh" prompts hit each other's cache (a
        # clean-clone run on 2026-12-04 failed test_repeats_are_pooled_and_keep_their_identity so).
        known = self.ids.get(word.strip(".?!,").lower())
        if known is not None:
            return known
        if word.startswith("<") and word.endswith(">") and word[1:-1].isdigit():
            return int(word[1:-1])
        return len(self.words) + zlib.crc32(word.encode())

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] if 0 <= i < len(self.words) else f"<{i}>" for i in ids)


CHAT_OVERHEAD_PER_MESSAGE = 3
CHAT_GENERATION_PROMPT = 2
BLOCK = calibration_dialect.KV_BLOCK_TOKENS
