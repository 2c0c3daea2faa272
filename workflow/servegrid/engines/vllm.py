"""vLLM as servegrid's engine: its flags, environment, endpoints, log lines and metric names.

Everything vLLM-specific lives here (see :mod:`servegrid.engines.base` for the
contract); it runs over 300 lines because the protocol is one class, its log
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
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from servegrid import redact
from servegrid.engines import metrics, vllm_preflight
from servegrid.engines.base import EngineFacts, EngineFinding, PrefixCache, ServerLaunch, StartupFacts
from servegrid.engines.vllm_log import engine_death, startup_facts
from servegrid.errors import ConfigError, ServerError

# Flags servegrid sets itself; a configuration that also set them would be ambiguous.
RESERVED_FLAGS = (
    "--host",
    "--port",
    "--model",
    "--served-model-name",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--speculative-config",
)
# Draft methods that read the target's hidden states (vLLM 0.32 SpeculativeConfig.use_eagle; every "<model>_mtp"
# method name is MTP too, renamed "mtp" by vLLM): with them a prefix-cache hit reuses one block fewer.
HIDDEN_STATE_DRAFTS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
API_KEY_VAR = "VLLM_API_KEY"  # what vLLM's server reads its key from

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
    ) -> None:
        for where, args in {"engine.args": engine_args, **configuration_args}.items():
            for arg in args:
                flag = normalized_flag(arg)
                if flag == "--api-key":
                    raise ConfigError(
                        f"{where}: '--api-key' would put the key in the server's argv and log; name the variable "
                        "that holds it in engine.api_key_env instead"
                    )
                if redact.is_secret_flag(arg):
                    # In the argv it is in `ps`, in launch.json and in vLLM's own "non-default args" log line.
                    raise ConfigError(
                        f"{where}: '{arg.split('=', 1)[0]}' would put a secret in the server's command line, where "
                        "`ps` and vLLM's own log show it; set it in the environment instead (e.g. HF_TOKEN, which "
                        "vLLM and huggingface_hub read), exported before the run, never in the config"
                    )
                if flag in RESERVED_FLAGS:
                    raise ConfigError(
                        f"{where}: '{arg.split('=', 1)[0]}' is set by servegrid "
                        "(use prefix_caching, speculative, model.served_name or operations instead)"
                    )
        for where, variables in env.items():
            if "CUDA_VISIBLE_DEVICES" in variables:
                raise ConfigError(f"{where}: set GPUs with 'gpus', not CUDA_VISIBLE_DEVICES")
            if API_KEY_VAR in variables:
                raise ConfigError(f"{where}: name the key's variable in engine.api_key_env, not {API_KEY_VAR}")
        dummy = vllm_preflight.flag_value(engine_args, "--load-format") == "dummy"
        if tiny_model == "dummy" and not dummy:
            raise ConfigError(
                "engine.args: model.tiny builds a folder without weights, so the engine needs '--load-format dummy'"
            )
        if tiny_model == "weights" and dummy:
            raise ConfigError(
                "engine.args: model.tiny.mtp writes the weights (its MTP layer is constructed to draft what the "
                "model says); '--load-format dummy' would replace them with random ones"
            )

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
            *args,
        ]

    def server_env(self, env: Mapping[str, str], gpus: Sequence[int], api_key: str | None) -> dict[str, str]:
        out = dict(env)
        if gpus:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        if api_key:
            out[API_KEY_VAR] = api_key
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
            out[name] = (out[name][0] + found, facts)
        return out

    def warm_up(self, client: httpx.Client, url: str, model: str) -> None:
        response = client.post(
            f"{url}{self.completions_path}",
            json={"model": model, "prompt": "warm up", "max_tokens": 8, "temperature": 0},
        )
        if response.status_code != 200:
            raise ServerError(f"warm-up request failed: HTTP {response.status_code}: {response.text[:500]}")

    def served_names(self, client: httpx.Client, url: str) -> list[str]:
        with contextlib.suppress(httpx.HTTPError):
            return self.names(client.get(f"{url}{self.names_path}").content)
        return []

    def names(self, body: bytes) -> list[str]:
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            return [str(entry["id"]) for entry in json.loads(body)["data"]]
        return []

    def describe(self, client: httpx.Client, url: str, model: str) -> EngineFacts:
        version = max_model_len = block_size = cache_mode = None
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
        return EngineFacts(version=version, max_model_len=max_model_len, block_size=block_size, cache_mode=cache_mode)

    def refusal(self, log_text: str) -> str | None:
        return engine_death(log_text)

    def prefix_cache(self, facts: EngineFacts, speculative: Mapping[str, Any] | None) -> PrefixCache:
        # vLLM 0.32 (config/speculative.py use_eagle_block_drop, v1/core/single_type_kv_cache_manager.py): a draft
        # that reads the target's hidden states makes the scheduler drop the last matched block of every hit,
        # unless the speculative config sets disable_eagle_block_drop.
        draft = speculative or {}
        method = str(draft.get("method") or "")
        drops = (method in HIDDEN_STATE_DRAFTS or method.endswith("_mtp")) and not draft.get("disable_eagle_block_drop")
        sightings = 2 if facts.cache_mode == "align" else 1
        return PrefixCache(block=facts.block_size or 1, dropped=1 if drops else 0, sightings=sightings)

    def reset_prefix_cache(self, client: httpx.Client, url: str) -> bool:
        # Served only with VLLM_SERVER_DEV_MODE=1; without it every cell still starts from fresh prompts.
        with contextlib.suppress(httpx.HTTPError, ValueError):
            response = client.post(f"{url}/reset_prefix_cache")
            return response.status_code == 200 and bool(response.json().get("success"))
        return False

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
