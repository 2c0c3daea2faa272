"""Write a tiny Qwen3-Next checkpoint's weights, with an MTP layer that drafts the token just produced.

Run by :func:`servegrid.serving.tiny_model.build` with the engine's own interpreter (the one that has torch and
transformers), as a program of its own: ``python -c <this file's text> FOLDER SEED``. It imports nothing of
servegrid. FOLDER holds the ``config.json`` the builder wrote; this adds ``model.safetensors``.

The main model is what transformers' own class initialises from a seeded generator (normal(0, 0.02) matrices,
its own initial values for norms and the recurrent layers' decay). Two things are constructed, both checked on
vLLM 0.32's CPU build (../shared/notes/vllm-cpu-hybrid-mtp.md):

- ``lm_head`` is a copy of ``embed_tokens`` (config keeps ``tie_word_embeddings: false``). The residual stream
  of these random layers stays close to the current token's embedding, so greedy decoding keeps producing the
  token it just produced: a repetitive continuation, as greedy decoding of random weights tends to fall into.
- The MTP layer (``mtp.*``, read by vLLM's ``qwen3_next_mtp.py``; it shares the target's embedding and
  ``lm_head``) passes the embedding half of its input through its projection ``fc`` (``[embedding, hidden]``,
  identity on the first half, zero on the second), its decoder layer's output projections (attention
  ``o_proj`` and every ``down_proj``) are zero so the residual passes unchanged, and its norms are at scale 1
  (Qwen3-Next's norms are zero-centred: weight 0 is scale 1). It therefore drafts "the same token again",
  which is what the target says: a stand-in for a trained head, whose acceptance the run measures.
"""

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM


def seeded_state(config: Any, seed: int) -> dict[str, Any]:  # config: transformers' PretrainedConfig
    """The state dict, in the checkpoint's own names, of transformers' model built from ``config`` with
    ``seed`` (written through ``save_pretrained``, which gives the names vLLM's loader reads)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        state = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                state.update({name: f.get_tensor(name).clone() for name in f.keys()})  # noqa: SIM118 - safe_open is not a dict
    return state


def main(folder: Path, seed: int) -> None:
    config = AutoConfig.from_pretrained(folder)
    state = seeded_state(config, seed)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()

    # The MTP layer: a full-attention decoder layer of the same shape, from a one-layer model of this config.
    one_layer = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    one_layer.update(num_hidden_layers=1, layer_types=["full_attention"])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(one_layer), encoding="utf-8")
        layer = seeded_state(AutoConfig.from_pretrained(tmp), seed + 1)
    hidden = config.hidden_size
    for name, tensor in layer.items():
        if not name.startswith("model.layers.0."):
            continue
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor = torch.zeros_like(tensor)
        state["mtp.layers.0." + name.removeprefix("model.layers.0.")] = tensor
    fc = torch.zeros(hidden, 2 * hidden, dtype=torch.bfloat16)
    fc[:, :hidden] = torch.eye(hidden, dtype=torch.bfloat16)
    state["mtp.fc.weight"] = fc
    for norm in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        state[norm] = torch.zeros(hidden, dtype=torch.bfloat16)
    save_file(
        {name: state[name].contiguous() for name in sorted(state)},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
