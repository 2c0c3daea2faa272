"""What the config says of a tiny model: its shape (:class:`TinyModelSpec`), and which folder it may replace.

The config layer's own: the experiment validates ``model.tiny`` and refuses a real model's folder before
anything runs, without loading the builder (:mod:`servegrid.serving.tiny_model`, the tokenizer's training).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servegrid.errors import ConfigError


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model; defaults are the ones seen working on 2 CPU cores."""

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


MARKER = "servegrid_tiny_model.json"  # in every folder build() writes: the only folders it may replace


def check_replaceable(out_dir: Path | str) -> None:
    """Refuse, naming the key, to replace a folder that servegrid did not build (a user's real model)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not (out_dir / MARKER).is_file():
        raise ConfigError(
            f"model.path: {out_dir} exists and is not a tiny model servegrid built (no {MARKER}); with model.tiny "
            "set it would be replaced. Point model.path at a new folder, or remove model.tiny to serve it as it is"
        )
