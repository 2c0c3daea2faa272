"""The tiny Qwen3-Next hybrid with its constructed MTP layer, written by the engine's own Python (torch,
transformers): what vLLM reads (../shared/notes/vllm-cpu-hybrid-mtp.md), reproducible byte for byte.

Read here without torch: a safetensors file is an 8-byte header length, a JSON header (name → dtype, shape,
offsets) and the raw tensors; bfloat16 is read as 16-bit words and widened to float32.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from helpers import VLLM_PYTHON
from servegrid.config.tiny_model_spec import TinyModelSpec
from servegrid.serving import tiny_model

pytestmark = pytest.mark.vllm

SPEC = TinyModelSpec(
    corpus_sentences=2000,
    architecture="qwen3_next",
    mtp="repeat",
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def tensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "BF16", (name, entry["dtype"])
        start, end = entry["data_offsets"]
        words = np.frombuffer(raw[8 + length + start : 8 + length + end], dtype="<u2").astype(np.uint32)
        out[name] = (words << 16).view(np.float32).reshape(entry["shape"])
    return out


def test_the_mtp_layer_is_built_to_draft_the_token_just_produced(tmp_path):
    first = tiny_model.build(tmp_path / "a", SPEC, [str(VLLM_PYTHON)])
    second = tiny_model.build(tmp_path / "b", SPEC, [str(VLLM_PYTHON)])
    assert first == second  # byte-identical, weights included
    weights = tensors(tmp_path / "a" / "model.safetensors")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["tie_word_embeddings"] is False
    hidden = SPEC.hidden_size

    # The target: seeded random layers, its lm_head the embedding (greedy decoding repeats the current token).
    embedding = weights["model.embed_tokens.weight"]
    assert embedding.shape == (config["vocab_size"], hidden) and 0.01 < embedding.std() < 0.03
    assert np.array_equal(weights["lm_head.weight"], embedding)
    assert weights["model.layers.0.linear_attn.in_proj_qkvz.weight"].std() > 0.01  # a recurrent layer, random

    # The MTP layer, in the names vLLM's qwen3_next_mtp.py reads: fc passes [embedding, hidden]'s first half,
    # every output projection is zero (the residual passes), the norms are at scale 1 (zero-centred: weight 0).
    fc = weights["mtp.fc.weight"]
    assert fc.shape == (hidden, 2 * hidden)
    assert np.array_equal(fc[:, :hidden], np.eye(hidden, dtype=np.float32)) and not fc[:, hidden:].any()
    zeroed = [n for n in weights if n.startswith("mtp.layers.0.") and n.endswith(("o_proj.weight", "down_proj.weight"))]
    assert len(zeroed) == 1 + 4 + 1  # attention, four experts, the shared expert
    assert not any(weights[n].any() for n in zeroed)
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        assert not weights[norm].any()
    assert weights["mtp.layers.0.self_attn.q_proj.weight"].std() > 0.01  # the rest of its layer: random
    assert not any(n.startswith("model.layers.4.") for n in weights)  # the MTP layer is not a fifth main layer
