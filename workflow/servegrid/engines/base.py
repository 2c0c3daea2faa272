"""The engine boundary: everything servegrid needs to know about one kind of inference server.

The server lifecycle (:mod:`servegrid.serving.server`), the cell (:mod:`servegrid.pipeline.cell_job`),
the workload modes (:mod:`servegrid.modes`) and the client talk to an engine
through this protocol only; nothing outside ``servegrid/engines/`` names a vLLM
flag, endpoint, environment variable or metric. A second engine is one more
module implementing :class:`Engine`, registered in :mod:`servegrid.engines`
(the tests register the calibration server this way, see
``servegrid.testing.engine``).

Metric names returned by :meth:`Engine.parse_metrics` are servegrid's canonical
ones (:data:`servegrid.engines.metrics.COUNTERS` and :data:`servegrid.engines.metrics.GAUGES`),
whatever the engine calls them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx


@dataclass(frozen=True)
class StartupFacts:
    """What an engine's start-up log says about its capacity (None where it does not say)."""

    kv_cache_tokens: int | None = None
    max_concurrency: float | None = None
    # The block size of each KV-cache group, where the engine has several and says so (vLLM logs them only then):
    # blocks of different sizes make where a prefix hit lands uncertain (PrefixCache.judged).
    kv_group_block_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EngineFacts:
    """What a running engine says about itself once warmed up (None where it does not say)."""

    version: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None  # KV-cache block (tokens): the granularity of prefix-cache hits
    # How a hybrid model's recurrent layers cache their state (vLLM's mamba_cache_mode: "align" saves it at every
    # block boundary, which is what lets a prefix hit at all); None for an engine that does not say.
    cache_mode: str | None = None
    # Where the engine computes prefix-cache keys more finely than its blocks (vLLM's --prefix-match-unit).
    prefix_match_unit: int | None = None


@dataclass(frozen=True)
class PrefixCache:
    """How a server's prefix cache hands out hits, as the server reports it (servegrid.engines: EngineFacts and
    the engine's rule for its draft method): what a mode's expected hit rate is counted in.

    ``block``: tokens per cacheable block; hits come in whole blocks (vLLM's block size: 16 on GPU, 128 on CPU,
    and for a hybrid model with prefix caching the enlarged block of its "align" mode, e.g. 384, since its
    recurrent state is saved only at those boundaries). ``dropped``: matched blocks the engine does not reuse at
    the end of a hit (vLLM drops the last one for drafts that read the target's hidden states: EAGLE, MTP)."""

    block: int = 1
    dropped: int = 0
    # Requests that must carry a prefix before a later one hits it. 1: the first request caches what it
    # computed. 2: a hybrid model in vLLM's "align" mode: a prefix is cached where the second request carrying
    # it parts from it (a shared prefix with suffixes of their own hit 0, 0, then 768 of 1,180 tokens at
    # 384-token blocks). A lower bound: a first request whose prompt ends just past a block boundary does leave
    # a state there (docs/verdict.md); more hits than expected never invalidate a cell.
    sightings: int = 1
    # False where the engine's hits may land on another granularity than ``block``: vLLM 0.32 lands them on the
    # least common multiple of its KV-cache groups' block sizes, or on their greatest common divisor (or
    # --prefix-match-unit) where partial hits are on, and says neither to its front end
    # (v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes). An expected hit rate is then not judged.
    judged: bool = True

    def hit_tokens(self, cached: int | float) -> int:
        """Tokens of a prompt that hit, when its first ``cached`` tokens are in the cache."""
        return max(int(cached) // self.block - self.dropped, 0) * self.block

    def held_tokens(self, tokens: int | float) -> int:
        """Tokens of the pool a request of ``tokens`` tokens holds: whole blocks."""
        return -(-int(tokens) // self.block) * self.block


# What a request to empty the prefix cache did: "reset"; "blocks held" when the engine refused because blocks are
# still in use (running requests, in-flight KV transfers: worth another try); "unavailable" when it serves no reset.
CacheReset = Literal["reset", "blocks held", "unavailable"]


@dataclass(frozen=True)
class EngineDeath:
    """An engine's death as its server's log tells it: the root cause in one line, and whether it is a fault of the
    moment (out of memory, the device, its driver or interconnect, a process killed from outside), which a fresh
    start may not meet, or the engine's own error, which it will."""

    cause: str
    transient: bool


@dataclass(frozen=True)
class EngineFinding:
    """What an engine's preflight found about one configuration's server, before it starts."""

    level: str  # "error" (the server would fail or measure the wrong thing), "warning", or "note"
    message: str
    # What to change: "gpus", "command", "args:<flag>", "env:<VARIABLE>", "speculative.<key>"; None if unknown.
    where: str | None = None


@dataclass(frozen=True)
class KvDemand:
    """What one request of the server's full length asks of each GPU's KV-cache pool: a server whose pool, what its
    memory claim leaves after the weights, cannot hold one such request does not start."""

    max_model_len: int
    bytes_per_token: float  # on each GPU: keys and values of the layers and heads it holds


@dataclass(frozen=True)
class ServerLaunch:
    """One configuration's server as it would start: its full argv and environment, its GPUs, its draft method."""

    argv: Sequence[str]
    env: Mapping[str, str]
    gpus: Sequence[int]
    speculative: Mapping[str, Any] | None


class Engine(Protocol):
    """One kind of inference server, as servegrid launches, drives and reads it."""

    kind: str  # the config's engine.kind
    display_name: str  # as the report names it ("vLLM")
    health_path: str
    names_path: str  # where it lists the names it answers to (see served_names)
    metrics_path: str
    completions_path: str
    chat_path: str

    # ---- configuration and launch ------------------------------------------------------
    def check_config(
        self,
        engine_args: Sequence[str],
        configuration_args: Mapping[str, Sequence[str]],
        env: Mapping[str, Mapping[str, str]],
        tiny_model: str | None,
        host: str = "127.0.0.1",
    ) -> None:
        """Raise :class:`servegrid.errors.ConfigError`, naming the key, for flags or variables servegrid sets
        itself (``configuration_args``/``env`` are keyed by config path, e.g. ``configurations.mtp.args``).
        ``tiny_model``: None (the user's model), "dummy" (model.tiny without weight files: the engine makes
        its own) or "weights" (model.tiny writes them: the engine must load them). ``host``: operations.host, the
        address the servers bind."""

    def context_limit(self, args: Sequence[str]) -> int | None:
        """The longest request (prompt + output tokens) the launch ``args`` allow, where they say; else None."""

    def feature_flags(self, prefix_caching: bool, speculative: Mapping[str, Any] | None) -> list[str]:
        """The launch flags that turn the compared features on or off."""

    def argv(
        self, command: Sequence[str], model: str, served_names: Sequence[str], host: str, port: int, args: Sequence[str]
    ) -> list[str]:
        """The server's full argv (never a shell string). It answers to every name in ``served_names``: the
        first is the one requests use, the others identify this launch (see :meth:`served_names`)."""

    def server_env(self, env: Mapping[str, str], gpus: Sequence[int], api_key: str | None) -> dict[str, str]:
        """Environment overrides for the server: ``env``, its devices and its API key."""

    def public_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with every secret masked, for logs, records and reports."""

    def startup_facts(self, log_text: str) -> StartupFacts:
        """Capacity facts from the server's start-up log."""

    def death(self, log_text: str) -> EngineDeath | None:
        """Where the server's log shows its engine dead: the root cause in one line, naming the exception and where
        it was raised, and whether it is a fault of the moment. None when the log shows no death of the engine (hung,
        still running, or its server killed before its engine could say)."""

    def prefix_cache(
        self, facts: EngineFacts, speculative: Mapping[str, Any] | None, startup: StartupFacts | None = None
    ) -> PrefixCache:
        """How the running server hands out prefix-cache hits: the block it reports, the matched blocks its draft
        method (``speculative``, as the config gives it) keeps from reuse, and whether its start-up log
        (``startup``) leaves where hits land certain."""

    def loads_checkpoint(self) -> bool:
        """Whether the server loads model.path (a checkpoint the preflight looks for)."""

    def gpu_memory_claim(self, argv: Sequence[str]) -> float:
        """The share of each GPU's memory the server with ``argv`` claims at start-up (0 where it claims none)."""

    def kv_demand(self, argv: Sequence[str], checkpoint: Mapping[str, Any] | None) -> KvDemand | None:
        """What one full-length request of the server with ``argv`` asks of each GPU's KV pool, from the
        checkpoint's config.json; None where the engine cannot tell (no config, a model that is not dense)."""

    def preflight(
        self, servers: Mapping[str, ServerLaunch], checkpoint: Mapping[str, Any] | None, probe_timeout_s: float | None
    ) -> dict[str, tuple[list[EngineFinding], dict[str, Any]]]:
        """What each server (configuration → launch) would refuse or silently do, without loading weights:
        configuration → (findings, facts such as the engine's version). ``checkpoint`` is the model's config.json
        where it is on this machine; ``probe_timeout_s`` None checks here only, without running the user's engine."""

    # ---- control plane (never timed) -------------------------------------------------------
    def warm_up(self, client: httpx.Client, url: str, model: str) -> None:
        """One tiny unmeasured request (the first after start is slow; later, a reused server's liveness check);
        raise ServerError if it fails."""

    def warm_up_cache(self, client: httpx.Client, url: str, model: str) -> dict[str, int] | None:
        """After :meth:`warm_up`, unmeasured requests that reach the code a cell will run: a prompt of more than two
        cache blocks, then a hit on it. Their facts (``prompt_tokens``, ``block_tokens``, ``hit_tokens`` the
        server counted) or None where there is nothing to cross; raise ServerError if a request fails."""

    def served_names(self, client: httpx.Client, url: str) -> list[str]:
        """The names the server at ``url`` answers to (empty if it does not say): how servegrid knows that a
        server is the one it launched, and not another process on the same port."""

    def names(self, body: bytes) -> list[str]:
        """The names in the server's answer at :attr:`names_path` (empty if it does not say): what each connection
        a cell opens is checked by (servegrid.measuring.client.Streamer.open_connections)."""

    def describe(self, client: httpx.Client, url: str, model: str) -> EngineFacts:
        """Version, context limit, KV block size and cache mode, as the running server reports them."""

    def reset_prefix_cache(self, client: httpx.Client, url: str) -> CacheReset:
        """Empty the server's prefix cache if it lets us (:data:`CacheReset`)."""

    def tokenize(self, client: httpx.Client, url: str, model: str, text: str) -> list[int]:
        """``text`` as the server's tokenizer makes it (no special tokens)."""

    def chat_prompt_tokens(
        self, client: httpx.Client, url: str, model: str, messages: Sequence[Mapping[str, str]]
    ) -> int:
        """Prompt length of ``messages`` as the server's chat template and tokenizer make it."""

    def detokenize(self, client: httpx.Client, url: str, model: str, tokens: Sequence[int]) -> str:
        """The text of ``tokens``."""

    # ---- measured requests ----------------------------------------------------------------
    def completion_payload(
        self, model: str, prompt: Sequence[int], output_tokens: int, temperature: float
    ) -> dict[str, Any]:
        """A streaming completion of exactly ``output_tokens`` tokens, with usage in every chunk."""

    def chat_payload(
        self, model: str, messages: Sequence[Mapping[str, str]], output_tokens: int, temperature: float
    ) -> dict[str, Any]:
        """A streaming chat completion of exactly ``output_tokens`` tokens, with usage in every chunk."""

    # ---- the server's own metrics -----------------------------------------------------------
    def parse_metrics(self, exposition: str, model: str | None) -> dict[str, float]:
        """The metrics page reduced to servegrid's canonical names, summed over label sets."""
