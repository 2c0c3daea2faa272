"""Secrets never reach disk, logs or reports: masked in every description, passed only through environments."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import copy_workflow, free_port_range, with_changes, write_yaml
from servegrid import redact
from servegrid.config import Experiment
from servegrid.errors import ConfigError


def test_secret_looking_names_and_flags_are_masked():
    assert redact.env({"HF_TOKEN": "t", "OPENAI_API_KEY": "k", "db_password": "p", "MY_SECRET_X": "s", "A": "1"}) == {
        "HF_TOKEN": "***", "OPENAI_API_KEY": "***", "db_password": "***", "MY_SECRET_X": "***", "A": "1",
    }  # fmt: skip
    assert redact.argv(["--api-key", "k", "--api_key=k", "--token", "t", "--port", "1", "--max-model-len", "8"]) == [
        "--api-key", "***", "--api_key=***", "--token", "***", "--port", "1", "--max-model-len", "8",
    ]  # fmt: skip


def test_an_api_key_flag_in_the_config_is_refused(demo_raw):
    from helpers import with_changes

    with pytest.raises(ConfigError, match=r"configurations\.ngram\.args: '--api-key' .* engine\.api_key_env"):
        Experiment(with_changes(demo_raw, **{"configurations.ngram.args": ["--api-key=abc"]}))


def test_the_launch_spec_snakemake_stores_has_its_secrets_masked(demo_raw):
    from helpers import with_changes

    raw = with_changes(demo_raw, **{"engine.env": {"HF_TOKEN": "canary-token", "VLLM_CPU_KVCACHE_SPACE": "1"}})
    experiment = Experiment(raw)
    assert experiment.launch_spec("ngram")["env"]["HF_TOKEN"] == "canary-token"  # the server gets it
    public = experiment.public_launch_spec("ngram")
    assert public["env"] == {"HF_TOKEN": "***", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert "canary-token" not in str(experiment.presentation())


KEY, TOKEN, SECRET = "canary-key-5f1d0c", "canary-token-9a2e41", "canary-secret-77b3aa"


def test_a_planted_key_and_secrets_appear_nowhere_after_a_whole_run(tmp_path):
    """A tiny grid through Snakemake, figures and both reports, against the calibration server (standing in
    for the engine's process: what is checked is servegrid's own writing); then every file is searched."""
    workdir = copy_workflow(tmp_path / "wf")
    config = {
        "experiment": {"title": "secret canary"},
        "model": {"path": "none", "served_name": "calibration"},
        "engine": {
            "command": [sys.executable, "-m", "servegrid.testing.calibration", "--model", "{model}"],
            "env": {"HF_TOKEN": TOKEN, "MY_SECRET_SETTING": SECRET, "PLAIN": "shown"},
            "api_key_env": "SERVEGRID_CANARY_KEY",
        },
        "configurations": {"only": {"label": "only", "prefix_caching": True}},
        "workloads": {"decode": {"contexts": [32], "concurrency": [1], "output_tokens": 4, "requests_per_session": 2}},
        # preflight off: the calibration stand-in serves no checkpoint (model.path "none" would be its error).
        "operations": {
            "port_range": list(free_port_range()),
            "startup_timeout_s": 60,
            "shutdown_timeout_s": 5,
            "preflight": False,
        },
    }
    write_yaml(workdir / "canary.yaml", config)
    env = {**os.environ, "SERVEGRID_CANARY_KEY": KEY}
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", "report", "--configfile", "canary.yaml"],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (workdir / "results" / "report" / "servegrid-pt.pdf").stat().st_size > 10_000
    assert KEY not in result.stdout + result.stderr
    searched, hits = 0, []
    for root in (workdir / "results", workdir / ".snakemake"):
        for path in root.rglob("*"):
            if path.is_file():
                searched += 1
                content = path.read_bytes()
                hits += [f"{path.relative_to(workdir)}: {c}" for c in (KEY, TOKEN, SECRET) if c.encode() in content]
    assert searched > 20  # cells, tables, figures, reports, logs, server records, Snakemake's metadata
    assert hits == []
    html = (workdir / "results" / "report" / "servegrid-pt.html").read_text()
    assert "HF_TOKEN=***" in html and "PLAIN=shown" in html  # masked, not dropped


@pytest.mark.parametrize(
    ("where", "args"),
    [("engine.args", ["--hf-token", "hf_abc"]), ("configurations.ngram.args", ["--hf_token=hf_abc"]),
     ("engine.args", ["--token=t"])],
)  # fmt: skip
def test_a_token_flag_is_refused_in_the_launch_arguments(demo_raw, where, args):
    """Masked in servegrid's records, a token in the argv would still be in `ps`, in launch.json and in vLLM's own
    "non-default args" log line, whose tail a failed start pastes into the cell's log: refused before anything runs."""
    flags = [*demo_raw["engine"]["args"], *args] if where == "engine.args" else args
    flag = args[0].split("=", 1)[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(where)}: '{re.escape(flag)}' would put a secret"):
        Experiment(with_changes(demo_raw, **{where: flags}))
