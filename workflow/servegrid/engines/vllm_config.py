"""What a configuration may hand vLLM: the flags and variables servegrid sets itself or keeps out of the argv, the
development routes kept on loopback, and the tiny models' load format (checked when the config is read)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from servegrid import redact
from servegrid.engines import vllm_preflight
from servegrid.errors import ConfigError

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
API_KEY_VAR = "VLLM_API_KEY"  # what vLLM's server reads its key from


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: what it resolves to is not known here
        return False


def check_config(
    engine_args: Sequence[str],
    configuration_args: Mapping[str, Sequence[str]],
    env: Mapping[str, Mapping[str, str]],
    tiny_model: str | None,
    host: str = "127.0.0.1",
) -> None:
    """:class:`ConfigError` naming the key where the engine's or a configuration's arguments or environment would
    clash with what servegrid sets, leak a secret, open the development routes beyond loopback, or not load the tiny
    model."""
    for where, args in {"engine.args": engine_args, **configuration_args}.items():
        for arg in args:
            flag = redact.flag_name(arg)
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
        dev_mode = variables.get(vllm_preflight.DEV_MODE_VAR, "0").strip()
        if dev_mode not in ("", "0") and not _loopback(host):
            # vLLM's API key guards /v1 only: its dev routes (/reset_prefix_cache, /sleep, /collective_rpc,
            # /server_info) answer anyone who reaches the port (issue 42, reproduced on vLLM 0.32).
            raise ConfigError(
                f"operations.host: {host!r} is not a loopback address and {where} sets "
                f"{vllm_preflight.DEV_MODE_VAR}={dev_mode}: vLLM's development routes (/collective_rpc, /sleep, "
                "/reset_prefix_cache) would answer anyone on the network, with or without the API key; bind "
                "127.0.0.1, or drop the variable (cells then measure on fresh content)"
            )
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
