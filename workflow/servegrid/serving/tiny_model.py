"""A tiny Qwen3-style model folder built offline: dense (vLLM's ``--load-format dummy``) or a Qwen3-Next hybrid.

Without an MTP layer vLLM initialises random weights itself, so the folder needs only a ``config.json`` and
tokenizer files. With one (``mtp: repeat``) the weights are written (:mod:`servegrid.serving.tiny_weights`, run
with the engine's interpreter, which has torch). The tokenizer is a byte-level BPE trained in about a second on
text from :mod:`servegrid.text`; everything is a pure function of the arguments, so two builds are
byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from servegrid import text
from servegrid.atomic import atomic_directory
from servegrid.config.tiny_model_spec import MARKER, TinyModelSpec, check_replaceable
from servegrid.errors import ConfigError, OutputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen models use it; vLLM's /v1/chat/completions needs a template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(spec: TinyModelSpec) -> Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # One rayon thread: BPE merge order must not depend on thread timing.
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.sentences(spec.corpus_seed, spec.corpus_sentences), trainer)
    return tokenizer


WEIGHTS_WRITER = Path(__file__).with_name("tiny_weights.py")
WEIGHTS_TIMEOUT_S = 600.0  # seconds on 2 cores: torch's import and a 12 MB checkpoint


def model_config(spec: TinyModelSpec, tokenizer: Tokenizer) -> dict:
    dense = _dense_config(spec, tokenizer)
    if spec.architecture == "qwen3":
        return dense
    # The Qwen3-Next layout (transformers' Qwen3NextConfig), at the spec's size: three linear-attention (gated
    # delta-net) layers to one full-attention layer, a sparse MoE in every layer.
    layers = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(spec.num_hidden_layers)]
    hybrid = dense | {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "layer_types": layers,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": spec.head_dim,
        "linear_value_head_dim": spec.head_dim,
        "linear_num_key_heads": spec.num_attention_heads,
        "linear_num_value_heads": 2 * spec.num_attention_heads,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "moe_intermediate_size": spec.intermediate_size // 4,
        "shared_expert_intermediate_size": spec.intermediate_size // 2,
        # lm_head is written apart (a copy of the embedding: tiny_weights), so not tied.
        "tie_word_embeddings": False,
    }
    if spec.mtp != "none":
        hybrid["num_nextn_predict_layers"] = 1
    return hybrid


def _dense_config(spec: TinyModelSpec, tokenizer: Tokenizer) -> dict:
    eos = tokenizer.token_to_id("<|im_end|>")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "eos_token_id": eos,
    }


def tokenizer_config(spec: TinyModelSpec) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": spec.max_position_embeddings,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def build(out_dir: Path, spec: TinyModelSpec | None = None, python: Sequence[str] = ()) -> dict[str, str]:
    """Write the model folder atomically; returns ``{file: sha256}``. Replaces only a folder it built.

    ``python``: the interpreter (an argv prefix) that writes the weights where the spec has them; it needs torch
    and transformers (the engine's, for vLLM)."""
    check_replaceable(out_dir)
    spec = spec or TinyModelSpec()
    spec.check()
    if spec.writes_weights and not python:
        raise ConfigError(
            "model.tiny.mtp: writing the weights needs the engine's Python (torch, transformers): engine.command "
            "must start it (`python -m vllm.entrypoints.openai.api_server` or a `vllm` script)"
        )
    tokenizer = train_tokenizer(spec)
    files = {
        "config.json": _json(model_config(spec, tokenizer)),
        "generation_config.json": _json({"eos_token_id": tokenizer.token_to_id("<|im_end|>")}),
        "tokenizer.json": tokenizer.to_str(pretty=False) + "\n",
        "tokenizer_config.json": _json(tokenizer_config(spec)),
        "chat_template.jinja": CHAT_TEMPLATE + "\n",
        MARKER: _json(asdict(spec)),
    }
    with atomic_directory(Path(out_dir)) as tmp:
        for name, content in files.items():
            (tmp / name).write_text(content, encoding="utf-8")
        if spec.writes_weights:
            _write_weights(tmp, spec, python)
        digests = {path.name: _sha256(path) for path in sorted(tmp.iterdir())}
    return digests


def engine_python(command: Sequence[str]) -> list[str]:
    """The interpreter ``engine.command`` starts (``python -m vllm...`` or a ``vllm`` script's), where it names
    one: it has torch and transformers. A relative path is taken from this folder, as the server's is."""
    from servegrid.engines.vllm_preflight import probe_target

    target = probe_target(command)
    if target is None:
        return []
    python = target[0]
    return [os.path.abspath(python) if os.sep in python else python]


def _write_weights(folder: Path, spec: TinyModelSpec, python: Sequence[str]) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        # As -c: run as a file, this folder would come first on sys.path (no shadowing there today, but the
        # engines' folder has a vllm.py and this keeps the two runs alike).
        done = subprocess.run(
            [*python, "-c", WEIGHTS_WRITER.read_text(encoding="utf-8"), str(folder), str(spec.weights_seed)],
            env=env,
            capture_output=True,
            text=True,
            timeout=WEIGHTS_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OutputError(f"model.tiny: writing the weights with {python[0]} failed: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise OutputError(f"model.tiny: writing the weights with {python[0]} exited {done.returncode}:\n{tail}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _json(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
