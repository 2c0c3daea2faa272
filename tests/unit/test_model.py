"""The tiny model folder is reproducible and loadable without any download."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

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
    from servegrid.errors import ConfigError

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
