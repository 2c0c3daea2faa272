"""What the config says of a tiny model: its shape (:class:`TinyModelSpec`), and which folder it may replace.

The config layer's own: the experiment validates ``model.tiny`` and refuses a real model's folder before
anything runs, without loading the builder (:mod:`servegrid.serving.tiny_model`, the tokenizer's training).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servegrid.errors import ConfigError

ARCHITECTURES = ("qwen3", "qwen3_next")  # dense Qwen3; Qwen3-Next hybrid (linear + full attention, a tiny MoE)
MTP_HEADS = ("none", "repeat")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model; defaults are the ones seen working on 2 CPU cores.

    ``architecture: qwen3_next`` is the shape of the Qwen models that ship MTP layers: three linear-attention
    layers to one full-attention layer (``num_hidden_layers`` a multiple of 4), four experts of a quarter of
    ``intermediate_size`` and a shared one of half. ``mtp: repeat`` (Qwen3-Next only) adds one MTP layer and
    writes real weight files (seeded random, from transformers' own classes): the MTP layer is constructed to
    draft the token the model just produced, which is what greedy decoding of these random weights keeps
    producing; a stand-in for a trained head, as ngram is for a draft model. ``mtp: none`` writes no weights
    (the engine initialises them: vLLM's ``--load-format dummy``).
    """

    vocab_size: int = 2048
    hidden_size: int = 512
    intermediate_size: int = 1536
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 64
    max_position_embeddings: int = 32768
    corpus_seed: int = 1234
    corpus_sentences: int = 20000
    architecture: str = "qwen3"
    mtp: str = "none"
    weights_seed: int = 2026  # the written weights' (mtp: repeat)

    @property
    def writes_weights(self) -> bool:
        return self.mtp != "none"

    def check(self) -> None:
        """Refuse, naming the key, a shape the builder cannot make."""
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"model.tiny.architecture: '{self.architecture}' is not one of {', '.join(ARCHITECTURES)}"
            )
        if self.mtp not in MTP_HEADS:
            raise ConfigError(f"model.tiny.mtp: '{self.mtp}' is not one of {', '.join(MTP_HEADS)}")
        if self.mtp != "none" and self.architecture != "qwen3_next":
            raise ConfigError("model.tiny.mtp: an MTP layer is built for architecture qwen3_next only")
        if self.architecture == "qwen3_next" and self.num_hidden_layers % 4:
            raise ConfigError(
                f"model.tiny.num_hidden_layers: qwen3_next has one full-attention layer in four; "
                f"{self.num_hidden_layers} is not a multiple of 4"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.tiny.num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )


MARKER = "servegrid_tiny_model.json"  # in every folder build() writes: the only folders it may replace


def check_replaceable(out_dir: Path | str) -> None:
    """Refuse, naming the key, to replace a folder that servegrid did not build (a user's real model)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not (out_dir / MARKER).is_file():
        raise ConfigError(
            f"model.path: {out_dir} exists and is not a tiny model servegrid built (no {MARKER}); with model.tiny "
            "set it would be replaced. Point model.path at a new folder, or remove model.tiny to serve it as it is"
        )
