"""One error root, caught in one place: the CLI and the Snakemake jobs print the same single headline."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import REPO, free_port_range, with_changes, write_yaml
from servegrid import errors


def test_every_expected_error_descends_from_the_root():
    for error in (
        errors.ConfigError,
        errors.UnknownModeError,
        errors.ServerError,
        errors.CellError,
        errors.CellFileError,
        errors.OutputError,
        errors.ReportError,
    ):
        assert issubclass(error, errors.ServegridError)


def test_guarded_turns_a_servegrid_error_into_one_line_and_an_exit_code(capsys):
    def bad_config() -> int:
        raise errors.ConfigError("workloads.decode.concurrency[1]: -4 is less than the minimum of 1")

    assert errors.guarded(bad_config) == 2
    assert (
        capsys.readouterr().err
        == "servegrid: error: workloads.decode.concurrency[1]: -4 is less than the minimum of 1\n"
    )
    assert errors.guarded(lambda: 0) == 0
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        errors.guarded(lambda: 1 // 0)


def cli(*args: str, cwd) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    return subprocess.run(
        [sys.executable, "-m", "servegrid.pipeline.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_the_cli_prints_one_clear_line_for_bad_input(tmp_path, demo_raw):
    write_yaml(tmp_path / "bad.yaml", with_changes(demo_raw, **{"workloads.decode.concurrency": [1, -4]}))
    result = cli("--config", "bad.yaml", "validate", cwd=tmp_path)
    assert result.returncode == 2
    assert (
        result.stderr
        == "servegrid: error: bad.yaml: workloads.decode.concurrency[1]: -4 is less than the minimum of 1\n"
    )
    assert "workloads.decode.concurrency[1]" in result.stderr and "Traceback" not in result.stderr
    result = cli(
        "--config", str(REPO / "config" / "cpu-demo.yaml"), "cell", "run", "ngram/decode/ctx512_c3", cwd=tmp_path
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == f"servegrid: error: {REPO / 'config' / 'cpu-demo.yaml'}: cell ngram/decode/ctx512_c3 is not in the grid"
    )


def test_a_server_that_will_not_start_is_one_headline_with_its_log_tail(tmp_path, demo_raw):
    exits = [sys.executable, "-c", "import sys; print('no such flag'); sys.exit(3)", "{model}"]
    changes = {
        "engine.command": exits,
        "model.tiny": None,
        "engine.args": [],
        "operations.port_range": list(free_port_range()),
        "operations.client_cpus": [],
    }
    raw = with_changes(demo_raw, **changes)
    for conf in raw["configurations"].values():
        conf["cpus"] = []
    write_yaml(tmp_path / "c.yaml", raw)
    result = cli("--config", "c.yaml", "cell", "run", "ngram/decode/ctx512_c1", cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("servegrid: error: "))
    # Before it only the run's progress lines (the grid, the server starting), logged at INFO.
    assert all(re.match(r"^\d{4}-\d\d-\d\d [\d:,]+ INFO servegrid\.", line) for line in lines[:at]), lines[:at]
    headline, *rest = lines[at:]
    assert headline.startswith("servegrid: error: the server for configuration 'ngram' exited during start-up")
    assert "no such flag" in "\n".join(rest)  # the log's tail follows the headline
    assert not any(line.startswith("servegrid: error: ") for line in rest)  # one headline
