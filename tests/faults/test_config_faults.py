"""Bad input, provoked for real: each config mistake run through Snakemake in a copy of the workflow, as a
user would type ``snakemake --cores 1 aggregate --configfile bad.yaml``.

Each bad config is the module's grid (the calibration server, four cells) changed in one place: a key given
twice, ``2.0`` where an integer belongs, a flag servegrid sets in another spelling, a context longer than
the ``--max-model-len`` in the config, ``model.tiny`` over a folder servegrid did not build. Each test checks
the four things of helpers.faults: (1) Snakemake fails at once, naming the key (or the line); (2) nothing is
written, and the folder ``model.tiny`` would have replaced is untouched; (3) no process survives; (4) the
next run completes: the last test runs the fixed grid to the aggregate tables in the same copy of the
workflow. tests/unit/test_config.py checks the same validations function by function; these go through
Snakemake's own config loading, where a key given twice is silently dropped.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml

from helpers import copy_workflow, write_yaml
from helpers.faults import Matrix, calibration_config, half_written, kill_survivors, wait_no_survivors
from servegrid.config import Experiment

TIMEOUT_S = 30  # a config error is found while Snakemake reads the Snakefile, before any job: seconds


def grid() -> dict[str, Any]:
    """The fixed config every fault changes in one place: two contexts × two concurrencies."""
    return calibration_config(
        decode={"contexts": [32, 128], "concurrency": [1, 2], "output_tokens": 8, "requests_per_session": 2}
    )


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One copy of the workflow for the whole module: each fault is tried in it, then the fixed grid runs
    there, as a user would rerun in the same folder."""
    path = copy_workflow(tmp_path_factory.mktemp("config-faults") / "wf")
    yield path
    kill_survivors(path)


def files_under(*folders: Path) -> dict[Path, tuple[int, int, bytes]]:
    """Every file's size, modification time and content: what 'nothing was written' is compared against."""
    return {
        p: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for folder in folders
        if folder.exists()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def run(tree: Path, config_name: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "1", "aggregate", "--configfile", config_name],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return time.monotonic() - started, result


def refused(tree: Path, matrix: Matrix, fault: str, config_name: str, says: str, *kept: Path) -> None:
    """Run Snakemake on ``config_name`` and check the four things (the fourth: test_the_fixed_grid_...)."""
    before = files_under(tree / "results", *kept)
    took, result = run(tree, config_name)
    output = result.stdout + result.stderr

    # (1) Refused at once, naming the key (or line) in the file given.
    assert result.returncode != 0, output[-3000:]
    assert took < TIMEOUT_S
    assert "ConfigError" in output and says in output, output[-3000:]
    matrix.record(fault, took)

    # (2) Nothing written, not even in part (no cell file, no table, no log, no .partial); what was there (the
    # folder model.tiny would replace) is as it was, byte for byte.
    assert files_under(tree / "results", *kept) == before
    assert half_written(tree) == []

    # (3) No process of this pipeline (none should have started).
    assert wait_no_survivors(tree, 10) == []


def test_a_key_given_twice_is_refused_naming_both_lines(tree, matrix):
    raw = grid()
    del raw["configurations"]
    text = yaml.safe_dump(raw, sort_keys=False) + (
        "configurations:\n"
        "  only:\n"
        "    label: only\n"
        "    prefix_caching: true\n"
        "  only:\n"  # a second configuration pasted under the same name: YAML keeps only this one
        "    label: without the cache\n"
        "    prefix_caching: false\n"
    )
    lines = text.splitlines()
    first = lines.index("  only:") + 1
    second = lines.index("  only:", first) + 1
    (tree / "duplicate.yaml").write_text(text)
    config = tree / "duplicate.yaml"
    says = f"{config}:{second}: duplicate key 'only' (first at line {first}); YAML would keep only the last one"
    refused(tree, matrix, "config-duplicate-key", config.name, says)


def test_a_float_where_an_integer_belongs_is_refused_naming_the_key(tree, matrix):
    raw = grid()
    raw["workloads"]["decode"]["concurrency"] = [1, 2.0]
    config = write_yaml(tree / "not-integer.yaml", raw)
    says = f"{config}: workloads.decode.concurrency[1]: 2.0 is not of type 'integer'"
    refused(tree, matrix, "config-not-integer", config.name, says)


def test_a_flag_servegrid_sets_is_refused_in_any_spelling(tree, matrix):
    raw = grid()
    raw["configurations"]["only"]["args"] = ["--enable_prefix_caching"]  # servegrid sets --enable-prefix-caching
    config = write_yaml(tree / "flag.yaml", raw)
    says = f"{config}: configurations.only.args: '--enable_prefix_caching' is set by servegrid"
    refused(tree, matrix, "config-flag-spelling", config.name, says)


def test_a_context_longer_than_the_configs_max_model_len_is_refused_naming_both_lengths(tree, matrix):
    raw = grid()
    raw["engine"]["args"] = ["--max-model-len", "64"]
    config = write_yaml(tree / "context.yaml", raw)
    says = (
        f"{config}: workloads.decode.contexts: at context 128 a request holds about 136 tokens, more than the 64 "
        "that configuration 'only' allows"
    )
    refused(tree, matrix, "config-context-too-long", config.name, says)


def test_a_tiny_model_over_a_folder_servegrid_did_not_build_is_refused_and_the_folder_kept(tree, matrix):
    folder = tree / "my-model"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(b"a user's real weights\n" * 100)
    raw = grid()
    raw["model"] = {"path": "my-model", "served_name": "calibration", "tiny": {}}
    # model.tiny builds a folder without weights, and the config is refused without this first: the flag the
    # tiny model needs (the calibration server ignores it) is part of setting model.tiny, not a second change.
    raw["engine"]["args"] = ["--load-format", "dummy"]
    config = write_yaml(tree / "tiny.yaml", raw)
    says = f"{config}: model.path: my-model exists and is not a tiny model servegrid built"
    refused(tree, matrix, "config-tiny-over-folder", config.name, says, folder)
    assert [p.name for p in folder.iterdir()] == ["model.safetensors"]


def test_the_fixed_grid_then_runs_to_the_aggregate_tables(tree):
    """Check (4) for every config fault above, once: none of them left anything behind that stops the next
    run, so one run of the fixed grid in the same folder stands for all."""
    config = write_yaml(tree / "fixed.yaml", grid())
    took, result = run(tree, config.name)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    cells = Experiment(grid()).cells()
    assert len(cells) == 4
    assert [c.path for c in cells if not (tree / c.path).is_file()] == []
    summary = pd.read_parquet(tree / "results" / "tables" / "summary.parquet")
    assert len(summary) == 4 and (summary["n_errors"] == 0).all()
    assert half_written(tree) == []
    assert wait_no_survivors(tree, 10) == []
    assert took < 300
