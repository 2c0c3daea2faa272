"""The calibration server's own dialect as a second servegrid engine (``engine.kind: calibration``).

It shares nothing on the wire with vLLM (:mod:`servegrid.testing.dialect`):
if any part of servegrid reached a server other than through its engine, a
cell on this engine would fail. Importing this module registers it; the
pipeline never does, only the tests.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from servegrid import engines, redact
from servegrid.engines import metrics
from servegrid.engines.base import (
    CacheReset,
    EngineDeath,
    EngineFacts,
    EngineFinding,
    KvDemand,
    PrefixCache,
    ServerLaunch,
    StartupFacts,
)
from servegrid.engines.vllm_log import engine_death
from servegrid.errors import ConfigError, ServerError
from servegrid.testing import dialect

PATHS = dialect.PATHS
# Flags this engine sets itself; a configuration that also set them would be ambiguous.
RESERVED_FLAGS = ("--dialect", "--listen", "--name", "--no-prefix-cache", "--speculative-tokens")
_CANONICAL = {own: canonical for canonical, own in dialect.METRIC_NAMES.items()}


def _canonical_name(sample_name: str) -> str | None:
    """servegrid's name for a sample of the calibration dialect; None for what servegrid does not read."""
    base, _, suffix = sample_name.rpartition("_")
    if suffix in ("sum", "count") and base in _CANONICAL:  # a histogram's sum or count
        return f"{_CANONICAL[base]}_{suffix}"
    return _CANONICAL.get(sample_name.removesuffix("_total"))


class CalibrationEngine:
    """The calibration server in its own dialect (``python -m servegrid.testing.calibration``)."""

    kind = "calibration"
    display_name = "calibration server"
    health_path = PATHS["health"]
    names_path = PATHS["info"]
    metrics_path = PATHS["metrics"]
    completions_path = PATHS["completions"]
    chat_path = PATHS["chat"]

    # ---- configuration and launch ------------------------------------------------------
    def check_config(
        self,
        engine_args: Sequence[str],
        configuration_args: Mapping[str, Sequence[str]],
        env: Mapping[str, Mapping[str, str]],
        tiny_model: str | None,
        host: str = "127.0.0.1",
    ) -> None:
        for where, args in {"engine.args": engine_args, **configuration_args}.items():
            for arg in args:
                if arg.split("=", 1)[0] in RESERVED_FLAGS:
                    raise ConfigError(f"{where}: '{arg.split('=', 1)[0]}' is set by servegrid")
        for where, variables in env.items():
            if dialect.API_KEY_VAR in variables:
                raise ConfigError(f"{where}: name the key's variable in engine.api_key_env, not {dialect.API_KEY_VAR}")

    def context_limit(self, args: Sequence[str]) -> int | None:
        return None  # the calibration server takes any length

    def feature_flags(self, prefix_caching: bool, speculative: Mapping[str, Any] | None) -> list[str]:
        flags = [] if prefix_caching else ["--no-prefix-cache"]
        if speculative:
            flags += ["--speculative-tokens", str(int(speculative.get("num_speculative_tokens", 1)))]
        return flags

    def argv(
        self, command: Sequence[str], model: str, served_names: Sequence[str], host: str, port: int, args: Sequence[str]
    ) -> list[str]:
        listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        command_argv = [part.replace("{model}", model) for part in command]
        return [*command_argv, "--dialect", dialect.CALIBRATION, "--listen", listen, "--name", *served_names, *args]

    def server_env(self, env: Mapping[str, str], gpus: Sequence[int], api_key: str | None) -> dict[str, str]:
        # The calibration server has no devices: a configuration's GPUs only decide who may run beside whom.
        return {**env, dialect.API_KEY_VAR: api_key} if api_key else dict(env)

    def public_env(self, env: Mapping[str, str]) -> dict[str, str]:
        return redact.env(env)  # its key's variable ends in _TOKEN

    def startup_facts(self, log_text: str) -> StartupFacts:
        found = dialect.STARTUP_RE.search(log_text)
        if not found:
            return StartupFacts()
        return StartupFacts(kv_cache_tokens=int(found.group(1)), max_concurrency=float(found.group(2)))

    def loads_checkpoint(self) -> bool:
        return False  # it has no model

    def gpu_memory_claim(self, argv: Sequence[str]) -> float:
        return 0.0

    def kv_demand(self, argv: Sequence[str], checkpoint: Mapping[str, Any] | None) -> KvDemand | None:
        return None  # it keeps no KV cache in a GPU's memory

    def preflight(
        self, servers: Mapping[str, ServerLaunch], checkpoint: Mapping[str, Any] | None, probe_timeout_s: float | None
    ) -> dict[str, tuple[list[EngineFinding], dict[str, Any]]]:
        # Its parser is servegrid's own (servegrid.testing.calibration): an unknown flag fails at start-up in a second.
        return {name: ([], {"engine": "calibration server"}) for name in servers}

    def death(self, log_text: str) -> EngineDeath | None:
        # Its engine-death fault prints what vLLM's engine core prints when it dies.
        return engine_death(log_text)

    def prefix_cache(
        self, facts: EngineFacts, speculative: Mapping[str, Any] | None, startup: StartupFacts | None = None
    ) -> PrefixCache:
        # The stand-in caches whole blocks and has no draft model: every matched block is reused.
        return PrefixCache(block=facts.block_size or 1)

    # ---- control plane -----------------------------------------------------------------
    def warm_up(self, client: httpx.Client, url: str, model: str) -> None:
        response = client.post(f"{url}{self.completions_path}", json=self.completion_payload(model, [1, 2, 3], 2, 0.0))
        if response.status_code != 200:
            raise ServerError(f"warm-up request failed: HTTP {response.status_code}: {response.text[:500]}")

    def warm_up_cache(self, client: httpx.Client, url: str, model: str) -> dict[str, int] | None:
        return None  # the stand-in has no cache code to die in, and its scripted faults count requests from 1

    def served_names(self, client: httpx.Client, url: str) -> list[str]:
        with contextlib.suppress(httpx.HTTPError):
            return self.names(client.get(f"{url}{self.names_path}").raise_for_status().content)
        return []

    def names(self, body: bytes) -> list[str]:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return [str(name) for name in json.loads(body)["names"]]
        return []

    def describe(self, client: httpx.Client, url: str, model: str) -> EngineFacts:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            info = client.get(f"{url}{PATHS['info']}").raise_for_status().json()
            return EngineFacts(
                version=info["build"], max_model_len=info["context_limit"], block_size=info["kv_block_tokens"]
            )
        return EngineFacts()

    def reset_prefix_cache(self, client: httpx.Client, url: str) -> CacheReset:
        with contextlib.suppress(httpx.HTTPError):
            if client.post(f"{url}{PATHS['reset_cache']}").status_code == 200:
                return "reset"
        return "unavailable"

    def tokenize(self, client: httpx.Client, url: str, model: str, text: str) -> list[int]:
        response = client.post(f"{url}{PATHS['tokenize']}", json={"model": model, "text": text})
        return list(response.raise_for_status().json()["ids"])

    def chat_prompt_tokens(
        self, client: httpx.Client, url: str, model: str, messages: Sequence[Mapping[str, str]]
    ) -> int:
        response = client.post(f"{url}{PATHS['tokenize']}", json={"model": model, "messages": list(messages)})
        return len(response.raise_for_status().json()["ids"])

    def detokenize(self, client: httpx.Client, url: str, model: str, tokens: Sequence[int]) -> str:
        response = client.post(f"{url}{PATHS['detokenize']}", json={"model": model, "ids": list(tokens)})
        return str(response.raise_for_status().json()["text"])

    # ---- measured requests ---------------------------------------------------------------
    def completion_payload(
        self, model: str, prompt: Sequence[int], output_tokens: int, temperature: float
    ) -> dict[str, Any]:
        # The server always reports usage in every chunk and never stops early: nothing else to ask for.
        return {
            "model": model,
            "prompt": list(prompt),
            dialect.OUTPUT_TOKENS_FIELD: output_tokens,
            "temperature": temperature,
            "stream": True,
        }

    def chat_payload(
        self, model: str, messages: Sequence[Mapping[str, str]], output_tokens: int, temperature: float
    ) -> dict[str, Any]:
        return {
            "model": model,
            "messages": list(messages),
            dialect.OUTPUT_TOKENS_FIELD: output_tokens,
            "temperature": temperature,
            "stream": True,
        }

    # ---- metrics ---------------------------------------------------------------------------
    def parse_metrics(self, exposition: str, model: str | None) -> dict[str, float]:
        def canonical(sample_name: str, labels: Mapping[str, str]) -> str | None:
            if model and labels.get(dialect.MODEL_LABEL, model) != model:
                return None
            return _canonical_name(sample_name)

        return metrics.canonical_values(exposition, canonical)


engines.register(CalibrationEngine.kind, CalibrationEngine)
