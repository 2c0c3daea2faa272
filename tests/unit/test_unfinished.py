"""What a failed run's last lines say is left (servegrid.reporting.unfinished, printed by the Snakefile's onerror)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from servegrid import paths
from servegrid.config import Experiment
from servegrid.reporting import unfinished
from servegrid.serving import procs, state
from servegrid.serving.state import Runtime


def test_each_configuration_left_is_named_with_its_reason(demo_raw, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    experiment = Experiment(demo_raw)
    runtime = Runtime(state_dir=str(tmp_path / "state"))
    owner = procs.ProcessRef.of(os.getpid())
    names = list(experiment.configurations)
    assert len(names) >= 2
    started_not, measured = names[0], names[1]
    for cell in experiment.cells(measured):
        Path(cell.path).parent.mkdir(parents=True, exist_ok=True)
        Path(cell.path).write_bytes(b"measured")
    assert unfinished.text(experiment, runtime, owner).count("cells not measured") == len(names) - 1

    # A failed start of this run names itself; a cell's own error is read from its log, with the log's path.
    message = "the server for configuration 'x' exited during start-up\nServer log: ..."
    state.write(
        state.failure_path(runtime, started_not), {"spec_hash": "h", "owner": owner.to_dict(), "message": message}
    )
    last = experiment.cells(measured)[-1]
    Path(last.path).unlink()
    log = Path(
        paths.CELL_LOG_PATTERN.format(
            configuration=measured, mode=last.mode, context=last.context, load=last.load.label
        )
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(
        "2026-12-07 01:00:00,000 INFO servegrid: measuring\n"
        "2026-12-07 01:00:09,000 ERROR servegrid: servegrid: error: made no progress for 31 s with requests in flight\n"
        "more of the message\n"
    )
    said = unfinished.text(experiment, runtime, owner)
    total = len(experiment.cells(started_not))
    assert (
        f"  {started_not}: {total} of {total} cells not measured; its server failed to start: the server for " in said
    )
    assert f"  {measured}: 1 of {len(experiment.cells(measured))} cells not measured; made no progress for 31 s" in said
    assert str(log) in said

    # Another run's failure record is not this run's reason.
    state.write(state.failure_path(runtime, started_not), {"spec_hash": "h", "owner": None, "message": message})
    assert "its server failed to start" not in unfinished.text(experiment, runtime, owner)

    for cell in experiment.cells():
        Path(cell.path).parent.mkdir(parents=True, exist_ok=True)
        Path(cell.path).write_bytes(b"measured")
    assert unfinished.text(experiment, runtime, owner) == ""


def test_top_ups_a_round_decided_and_the_run_left_are_named_with_their_reason(demo_raw, tmp_path, monkeypatch):
    """Sampling that serves the verdict: every cell measured, round 1 decided to top up three cells of one
    configuration, one top-up measured, one failed (its log says why), one not reached."""
    monkeypatch.chdir(tmp_path)
    demo_raw["sampling"] |= {"policy": "verdict", "top_up_rounds": 2}
    experiment = Experiment(demo_raw)
    runtime = Runtime(state_dir=str(tmp_path / "state"))
    owner = procs.ProcessRef.of(os.getpid())
    for cell in experiment.cells():
        Path(cell.path).parent.mkdir(parents=True, exist_ok=True)
        Path(cell.path).write_bytes(b"measured")
    assert unfinished.text(experiment, runtime, owner) == ""
    name = next(iter(experiment.configurations))
    done, failed, not_reached = experiment.cells(name)[:3]
    Path(paths.decision(1)).parent.mkdir(parents=True, exist_ok=True)
    Path(paths.decision(1)).write_text(
        json.dumps({"format_version": 1, "top_up": [done.id, failed.id, not_reached.id, "gone/decode/ctx1_c1"]})
    )
    Path(done.top_up_path(1)).parent.mkdir(parents=True, exist_ok=True)
    Path(done.top_up_path(1)).write_bytes(b"measured")
    log = Path(
        paths.TOP_UP_LOG_PATTERN.format(
            configuration=name, mode=failed.mode, context=failed.context, load=failed.load.label, round=1
        )
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("2026-12-08 00:00:00,000 ERROR servegrid: servegrid: error: the server for 'x' exited\n")
    said = unfinished.text(experiment, runtime, owner)
    assert f"  {name}: 2 top-up(s) of round 1 not measured; the server for 'x' exited ({log})" in said, said
    assert "cells not measured" not in said
