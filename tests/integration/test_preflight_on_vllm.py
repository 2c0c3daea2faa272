"""servegrid preflight through the real vLLM (the CPU build standing in for the user's own): its parser, its
validation and its engine configuration refuse what a server would refuse, before any weights load, each finding
naming the key to change. One probe process per run of the checks (importing vLLM is most of its time)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import REPO, VLLM_PYTHON, with_changes
from servegrid.config import Experiment
from servegrid.planning import preflight
from servegrid.serving import tiny_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("preflight") / "tiny-qwen3"
    tiny_model.build(folder)
    return folder


def test_vllms_own_parser_and_configuration_refuse_what_the_server_would(demo_raw, tiny_checkpoint):
    raw = with_changes(demo_raw, **{"model.path": str(tiny_checkpoint)})
    raw["engine"]["command"] = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}"]
    raw["configurations"]["prefix_cache"]["args"] = ["--no-such-flag"]
    raw["configurations"]["ngram"]["args"] = ["--max-num-seqs", "many"]
    raw["configurations"]["both"]["speculative"] = {"method": "mtp", "num_speculative_tokens": 1}  # a dense Qwen3
    report = preflight.run(Experiment(raw), environ={})
    errors = {(f.configuration, f.key): f.message for f in report.errors}
    refused = errors[("prefix_cache", "configurations.prefix_cache.args (--no-such-flag)")]
    assert "unrecognized arguments: --no-such-flag" in refused
    assert "invalid int value: 'many'" in errors[("ngram", "configurations.ngram.args (--max-num-seqs)")]
    # servegrid reads the checkpoint's config.json; vLLM's engine configuration refuses the method in its own words.
    assert "has none" in errors[("both", "configurations.both.speculative.method")]
    engine_says = [m for (name, _), m in errors.items() if name == "both" and "before loading weights" in m]
    assert engine_says and "mtp" in engine_says[0].lower(), errors
    assert report.facts["both"]["vllm_version"] == "0.32.0"


def test_the_seed_config_here_says_what_it_checked_and_what_it_could_not(seed_raw, monkeypatch):
    """config.yaml on this machine, the CPU build as "the user's vLLM" (`vllm` on PATH): the flags pass vLLM's own
    parser; the GPUs and the checkpoint (not here) are said to be unchecked."""
    monkeypatch.setenv("PATH", f"{VLLM_PYTHON.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)
    report = preflight.run(Experiment(seed_raw), environ={})
    assert report.errors == [], report.text()
    for name in ("prefix_cache", "mtp", "mtp_prefix_cache"):
        assert "flags: validate_parsed_serve_args" in report.checked[name]
        assert "engine configuration: create_engine_config" not in report.checked[name]  # no checkpoint here
    text = report.text()
    assert "UNCHECKED GPUs: no nvidia-smi" in text and "not on this machine" in text


def test_a_file_the_offline_cache_lacks_is_a_warning_where_the_server_may_download_it(tiny_checkpoint, tmp_path):
    """Issue 42: the Hugging Face cache holds a Hub checkpoint's config.json alone (what an earlier preflight
    fetched), and building the engine's configuration needs another file (here a tokenizer from another repo). The
    probe never downloads, the server will: unchecked, a warning, never an error that stops the run."""
    from servegrid.engines import vllm_preflight

    repo = tmp_path / "hf" / "hub" / "models--someorg--tiny"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123" / "config.json").write_bytes((tiny_checkpoint / "config.json").read_bytes())
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", "someorg/tiny"]
    argv += ["--tokenizer", "someorg/not-cached", "--max-model-len", "4096"]
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}  # the server may download; the probe never does
    findings, _ = vllm_preflight.probe({"tiny": argv}, env, 600)["tiny"]
    assert [f.level for f in findings] == ["warning"], findings
    assert "the offline cache does not hold" in findings[0].message and "LocalEntryNotFoundError" in findings[0].message
