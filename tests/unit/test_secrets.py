"""Secrets never reach disk, logs or reports: masked in every description, passed only through environments."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import copy_workflow, free_port_range, with_changes, write_yaml
from servegrid import redact
from servegrid.config import Experiment
from servegrid.errors import ConfigError


def test_secret_looking_names_and_flags_are_masked():
    assert redact.env({"HF_TOKEN": "t", "OPENAI_API_KEY": "k", "db_password": "p", "MY_SECRET_X": "s", "A": "1"}) == {
        "HF_TOKEN": "***",
        "OPENAI_API_KEY": "***",
        "db_password": "***",
        "MY_SECRET_X": "***",
        "A": "1",
    }
    assert redact.argv(["--api-key", "k", "--api_key=k", "--token", "t", "--port", "1", "--max-model-len", "8"]) == [
        "--api-key",
        "***",
        "--api_key=***",
        "--token",
        "***",
        "--port",
        "1",
        "--max-model-len",
        "8",
    ]


def test_an_api_key_flag_in_the_config_is_refused(demo_raw):
    from helpers import with_changes

    with pytest.raises(ConfigError, match=r"configurations\.ngram\.args: '--api-key' .* engine\.api_key_env"):
        Experiment(with_changes(demo_raw, **{"configurations.ngram.args": ["--api-key=abc"]}))


@pytest.mark.parametrize("where", ["engine.env", "configurations.ngram.env"])
def test_a_secrets_value_in_the_config_is_refused(demo_raw, where):
    """Snakemake pickles the whole config into each job's script (.snakemake/scripts/), which a killed run leaves
    on disk: a secret comes from the environment, which the servers inherit."""
    raw = with_changes(demo_raw, **{where: {"HF_TOKEN": "canary-token", "VLLM_CPU_KVCACHE_SPACE": "1"}})
    with pytest.raises(ConfigError, match=rf"{re.escape(where)}\.HF_TOKEN: a secret's value does not go in the config"):
        Experiment(raw)
    plain = Experiment(with_changes(demo_raw, **{where: {"VLLM_CPU_KVCACHE_SPACE": "1"}}))
    assert plain.public_launch_spec("ngram")["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"


KEY, TOKEN, SECRET = "canary-key-5f1d0c", "canary-token-9a2e41", "canary-secret-77b3aa"
CANARIES = {"SERVEGRID_CANARY_KEY": KEY, "HF_TOKEN": TOKEN, "MY_SECRET_SETTING": SECRET}


def canary_workdir(tmp_path: Path) -> Path:
    """A tiny grid against the calibration server (standing in for the engine's process: what is checked is
    servegrid's own writing); the secrets are in the environment only (CANARIES)."""
    workdir = copy_workflow(tmp_path / "wf")
    config = {
        "experiment": {"title": "secret canary"},
        "model": {"path": "none", "served_name": "calibration"},
        "engine": {
            "command": [sys.executable, "-m", "servegrid.testing.calibration", "--model", "{model}"],
            "env": {"PLAIN": "shown"},
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
    return workdir


def canaries_found(workdir: Path) -> tuple[int, list[str]]:
    """Every file under results/ and .snakemake/ searched for the canaries: (files searched, hits)."""
    searched, hits = 0, []
    for root in (workdir / "results", workdir / ".snakemake"):
        for path in root.rglob("*"):
            if path.is_file():
                searched += 1
                content = path.read_bytes()
                hits += [f"{path.relative_to(workdir)}: {c}" for c in CANARIES.values() if c.encode() in content]
    return searched, hits


def test_a_planted_key_and_secrets_appear_nowhere_after_a_whole_run(tmp_path):
    """Through Snakemake, figures and both reports; then every file is searched."""
    workdir = canary_workdir(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", "report", "--configfile", "canary.yaml"],
        cwd=workdir,
        env={**os.environ, **CANARIES},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (workdir / "results" / "report" / "servegrid-pt.pdf").stat().st_size > 10_000
    assert not [c for c in CANARIES.values() if c in result.stdout + result.stderr]
    searched, hits = canaries_found(workdir)
    assert searched > 20  # cells, tables, figures, reports, logs, server records, Snakemake's metadata
    assert hits == []
    html = (workdir / "results" / "report" / "servegrid-pt.html").read_text()
    assert "PLAIN=shown" in html


def test_nothing_secret_is_on_disk_after_a_killed_run(tmp_path):
    """``kill -9`` of Snakemake while its cell job runs: no handler cleans up, so Snakemake's job scripts (the
    config pickled in) stay under .snakemake/scripts/. The server had its secrets (its environment), the disk has
    none."""
    from helpers.faults import kill_survivors, wait_for, wait_no_survivors
    from servegrid import paths
    from servegrid.serving import state

    workdir = canary_workdir(tmp_path)
    with open(workdir / "snakemake.out", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "snakemake", "--cores", "1", "aggregate", "--configfile", "canary.yaml"],
            cwd=workdir,
            env={**os.environ, **CANARIES},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        record_path = state.host_directory(workdir / paths.STATE_DIR) / "only.json"
        assert wait_for(lambda: (state.read(record_path) or {}).get("status") == "running", 120), "no server started"
        environ = Path(f"/proc/{state.read(record_path)['server']['pid']}/environ").read_bytes()
        assert TOKEN.encode() in environ and SECRET.encode() in environ  # the server inherited them
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert wait_no_survivors(workdir, 60) == []
    finally:
        kill_survivors(workdir)
    assert list((workdir / ".snakemake" / "scripts").glob("*.py")), "no job script left: the kill came too late"
    searched, hits = canaries_found(workdir)
    assert searched > 5
    assert hits == []


@pytest.mark.parametrize(
    ("where", "args"),
    [
        ("engine.args", ["--hf-token", "hf_abc"]),
        ("configurations.ngram.args", ["--hf_token=hf_abc"]),
        ("engine.args", ["--token=t"]),
    ],
)
def test_a_token_flag_is_refused_in_the_launch_arguments(demo_raw, where, args):
    """Masked in servegrid's records, a token in the argv would still be in `ps`, in launch.json and in vLLM's own
    "non-default args" log line, whose tail a failed start pastes into the cell's log: refused before anything runs."""
    flags = [*demo_raw["engine"]["args"], *args] if where == "engine.args" else args
    flag = args[0].split("=", 1)[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(where)}: '{re.escape(flag)}' would put a secret"):
        Experiment(with_changes(demo_raw, **{where: flags}))
