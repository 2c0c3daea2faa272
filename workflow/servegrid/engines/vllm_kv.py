"""A vLLM server's KV cache: where its prefix-cache hits land (:func:`prefix_cache`), and what one full-length
request asks of its pool on each GPU (:func:`kv_demand`), from the launch flags and the
checkpoint's config.json, as vLLM 0.32 sizes it before it starts (issue 42: a pool too small for ``--max-model-len``
is found at start-up, after the weights load, a wasted start of minutes on a large model).

Dense models only: keys and values of every layer's KV heads (``ModelConfig.get_num_kv_heads``: the heads split
across the tensor-parallel ranks, at least one each; the layers across the pipeline stages), in the KV dtype. A
hybrid model (recurrent layers), sliding-window layers or multi-head latent attention size their cache otherwise:
None, unchecked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from servegrid.engines.base import EngineFacts, KvDemand, PrefixCache, StartupFacts
from servegrid.engines.vllm_preflight import flag_value

# --kv-cache-dtype values of one byte an element (vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE); "auto" and
# the 16-bit ones take the model's dtype. The packed 4-bit and per-token-scale kinds are not counted here.
ONE_BYTE_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
MODEL_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# What makes a model's cache other than dense full attention (config.json keys and layer kinds).
FULL_ATTENTION_LAYERS = ("full_attention", "attention")


# vLLM's human-readable integers (vllm/utils/argparse_utils.py human_readable_int): lower case decimal, upper case
# binary ("32k" is 32,000, "32K" 32,768).
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def _int_flag(argv: Sequence[str], *names: str) -> int | None:
    """An integer flag as vLLM reads it, its human-readable suffixes included; None where absent, ``auto`` or -1."""
    value = flag_value(argv, *names)
    if value is None:
        return None
    text = value.strip()
    scale = _SUFFIXES.get(text[-1:], 1) if text else 1
    try:
        number = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        return None
    return number if number > 0 else None


def _dense(config: Mapping[str, Any]) -> bool:
    layer_kinds = config.get("layer_types") or []
    sliding = config.get("sliding_window") and config.get("use_sliding_window", True)
    return (
        all(kind in FULL_ATTENTION_LAYERS for kind in layer_kinds)
        and not sliding
        and not config.get("kv_lora_rank")  # multi-head latent attention (DeepSeek): a latent, not K and V
    )


def kv_demand(argv: Sequence[str], checkpoint: Mapping[str, Any] | None) -> KvDemand | None:
    """Each GPU's share of one request of ``--max-model-len`` tokens (else the checkpoint's
    ``max_position_embeddings``); None where it cannot be told from here."""
    if not checkpoint:
        return None
    config = checkpoint.get("text_config") or checkpoint  # a multimodal checkpoint keeps its language model there
    if not _dense(config):
        return None
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    cache_dtype = (flag_value(argv, "--kv-cache-dtype") or "auto").lower()
    if cache_dtype in ONE_BYTE_KV:
        element = 1
    elif cache_dtype in ("auto", "bfloat16", "float16"):
        model_dtype = str(flag_value(argv, "--dtype") or "auto").lower()
        if model_dtype == "auto":
            model_dtype = str(config.get("torch_dtype") or config.get("dtype") or checkpoint.get("torch_dtype") or "")
        element = 2 if cache_dtype != "auto" else MODEL_DTYPE_BYTES.get(model_dtype.lower(), 2)
    else:
        return None
    max_len = _int_flag(argv, "--max-model-len") or config.get("max_position_embeddings")
    if not isinstance(max_len, int) or max_len <= 0:
        return None
    tensor = max(1, _int_flag(argv, "--tensor-parallel-size", "-tp") or 1)
    pipeline = max(1, _int_flag(argv, "--pipeline-parallel-size", "-pp") or 1)
    heads_per_gpu = max(1, kv_heads // tensor)
    layers_per_gpu = -(-layers // pipeline)  # the largest stage
    return KvDemand(max_model_len=max_len, bytes_per_token=2.0 * layers_per_gpu * heads_per_gpu * head_dim * element)


# Draft methods that read the target's hidden states (vLLM 0.32 SpeculativeConfig.use_eagle; every "<model>_mtp"
# method name is MTP too, renamed "mtp" by vLLM): with them a prefix-cache hit reuses one block fewer.
HIDDEN_STATE_DRAFTS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})


def prefix_cache(
    facts: EngineFacts, speculative: Mapping[str, Any] | None, startup: StartupFacts | None = None
) -> PrefixCache:
    """How a running vLLM server hands out prefix-cache hits (VLLMEngine.prefix_cache)."""
    # vLLM 0.32 (config/speculative.py use_eagle_block_drop, v1/core/single_type_kv_cache_manager.py): a draft
    # that reads the target's hidden states makes the scheduler drop the last matched block of every hit,
    # unless the speculative config sets disable_eagle_block_drop.
    draft = speculative or {}
    method = str(draft.get("method") or "")
    drops = (method in HIDDEN_STATE_DRAFTS or method.endswith("_mtp")) and not draft.get("disable_eagle_block_drop")
    sightings = 2 if facts.cache_mode == "align" else 1
    # Several KV-cache groups (vLLM 0.32 v1/core/kv_cache_utils.py resolve_kv_cache_block_sizes): hits land on
    # the LCM of their block sizes, or on their GCD or --prefix-match-unit where partial hits are on, which
    # the engine does not tell its front end. Certain only where every group has the front end's block size
    # and no finer match unit is set.
    groups = (startup.kv_group_block_sizes if startup else None) or ()
    uncertain = bool(groups) and (
        set(groups) != {facts.block_size} or facts.prefix_match_unit not in (None, facts.block_size)
    )
    return PrefixCache(
        block=facts.block_size or 1, dropped=1 if drops else 0, sightings=sightings, judged=not uncertain
    )
