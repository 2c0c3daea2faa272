"""A tiny Qwen3-style model folder built offline, for vLLM's ``--load-format dummy``.

vLLM initialises random weights itself, so the folder needs only a
``config.json`` and tokenizer files. The tokenizer is a byte-level BPE trained
in about a second on text from :mod:`servegrid.text`; everything is a pure
function of the arguments, so two builds are byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from servegrid import text
from servegrid.atomic import atomic_directory
from servegrid.config.tiny_model_spec import MARKER, TinyModelSpec, check_replaceable

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


def model_config(spec: TinyModelSpec, tokenizer: Tokenizer) -> dict:
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


def build(out_dir: Path, spec: TinyModelSpec | None = None) -> dict[str, str]:
    """Write the model folder atomically; returns ``{file: sha256}``. Replaces only a folder it built."""
    check_replaceable(out_dir)
    spec = spec or TinyModelSpec()
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
    return {name: hashlib.sha256(content.encode()).hexdigest() for name, content in files.items()}


def _json(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"
