"""The tiny model folder is reproducible and loadable without any download."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from tokenizers import Tokenizer

from servegrid.config.tiny_model_spec import TinyModelSpec
from servegrid.errors import ConfigError
from servegrid.serving import tiny_model


def test_build_is_byte_identical_and_complete(tmp_path):
    spec = tiny_model.TinyModelSpec(corpus_sentences=2000)
    first = tiny_model.build(tmp_path / "a", spec)
    second = tiny_model.build(tmp_path / "b", spec)
    assert first == second
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).is_file()
    # No leftovers of the atomic write.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_config_and_tokenizer_agree(tmp_path):
    tiny_model.build(tmp_path / "m", tiny_model.TinyModelSpec(corpus_sentences=2000))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["vocab_size"] == tokenizer.get_vocab_size()
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("The cache server answers the question.").ids
    assert tokenizer.decode(ids) == "The cache server answers the question."
    assert len(ids) < 12  # whole-word merges were learned


def test_rebuild_replaces_the_folder(tmp_path):
    target = tmp_path / "m"
    tiny_model.build(target, tiny_model.TinyModelSpec(corpus_sentences=2000))
    (target / "stale.txt").write_text("old")
    tiny_model.build(target, tiny_model.TinyModelSpec(corpus_sentences=2000))
    assert not (target / "stale.txt").exists()


def test_a_folder_servegrid_did_not_build_is_never_replaced(tmp_path, demo_raw):
    from helpers import with_changes
    from servegrid.config import Experiment

    real = tmp_path / "my-model"
    real.mkdir()
    (real / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ConfigError, match=r"model\.path: .*my-model exists and is not a tiny model servegrid built"):
        tiny_model.build(real, tiny_model.TinyModelSpec(corpus_sentences=2000))
    assert (real / "model.safetensors").read_bytes() == b"weights"
    with pytest.raises(ConfigError, match=r"model\.path: .*my-model exists"):  # refused before anything runs
        Experiment(with_changes(demo_raw, **{"model.path": str(real)}))
    (tmp_path / "empty").mkdir()
    tiny_model.build(tmp_path / "empty", tiny_model.TinyModelSpec(corpus_sentences=2000))  # an empty folder is fine


def test_a_hybrid_is_three_linear_attention_layers_to_one_full_attention_layer(tmp_path):
    """The layout of the Qwen models that ship MTP layers (Qwen3-Next), at the spec's size; an MTP layer only
    where asked for, and then the weights are written (a test of its own: tests/integration/test_tiny_hybrid.py)."""
    spec = tiny_model.TinyModelSpec(
        corpus_sentences=2000,
        architecture="qwen3_next",
        num_hidden_layers=8,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    tiny_model.build(tmp_path / "m", spec)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["model_type"] == "qwen3_next"
    assert config["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert (config["num_experts"], config["moe_intermediate_size"], config["linear_num_value_heads"]) == (4, 384, 8)
    assert "num_nextn_predict_layers" not in config and not (tmp_path / "m" / "model.safetensors").exists()
    with pytest.raises(ConfigError, match=r"model\.tiny\.mtp: writing the weights needs the engine's Python"):
        tiny_model.build(tmp_path / "n", TinyModelSpec(**{**asdict(spec), "mtp": "repeat"}))
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize(
    ("tiny", "args", "says"),
    [
        ({"mtp": "repeat"}, [], r"model\.tiny\.mtp: an MTP layer is built for architecture qwen3_next only"),
        (
            {"architecture": "qwen3_next", "num_hidden_layers": 6},
            ["--load-format", "dummy"],
            r"model\.tiny\.num_hidden_layers: qwen3_next has one full-attention layer in four; 6 is not a multiple",
        ),
        ({"architecture": "mamba"}, [], r"model\.tiny\.architecture: 'mamba' is not one of"),
        (
            {"architecture": "qwen3_next", "mtp": "repeat"},
            ["--load-format=dummy"],
            r"engine\.args: model\.tiny\.mtp writes the weights .*'--load-format dummy' would replace them",
        ),
        ({}, [], r"engine\.args: model\.tiny builds a folder without weights, so the engine needs '--load-format"),
    ],
    ids=["mtp-on-dense", "layers", "architecture", "dummy-over-weights", "no-weights-no-dummy"],
)
def test_a_tiny_model_the_builder_cannot_make_is_refused_before_anything_runs(demo_raw, tiny, args, says):
    from helpers import with_changes
    from servegrid.config import Experiment

    raw = with_changes(demo_raw, **{"model.tiny": tiny, "engine.args": ["--max-model-len", "8192", *args]})
    with pytest.raises(ConfigError, match=says):
        Experiment(raw)


def test_the_hybrid_demo_config_is_valid():
    from helpers import REPO
    from servegrid.config import Experiment

    experiment = Experiment.from_file(REPO / "config" / "cpu-hybrid-demo.yaml")
    spec = TinyModelSpec(**experiment.tiny_model_spec())
    assert (spec.architecture, spec.mtp, spec.writes_weights) == ("qwen3_next", "repeat", True)
