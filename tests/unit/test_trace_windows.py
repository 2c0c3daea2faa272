"""A trace's windows, its second grid axis beside the speedups (servegrid.modes.trace, trace_file.Window): cells named
by window, each window's own rate and identity (a trace edited outside a cell's window and drain reruns none of its
cells), and the drain: the trace's arrivals after a window keep the load on while the window's last requests finish,
sent on their own schedule and never measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_trace import MOONCAKE_SLICE, replay, trace_experiment

from servegrid.config import Experiment
from servegrid.errors import ConfigError
from servegrid.modes import trace_source
from servegrid.modes.trace_file import Window

# The Mooncake slice's arrivals (ms): lines 1-7 at 0, 8-11 at 3000, 12-14 at 5999, 15-17 at 9000, 18-20 at 12000.
HALVES = [{"start_s": 0, "duration_s": 6}, {"start_s": 6, "duration_s": 6}]


def slice_experiment(path: Path, windows: list[dict], max_in_flight: int = 2) -> Experiment:  # type: ignore[type-arg]
    return trace_experiment(
        {"file": str(path)},
        [1, 2],
        block_tokens=512,
        windows=windows,
        open_loop={"ramp_s": 0, "max_in_flight": max_in_flight},
    )


def settings_by_cell(experiment: Experiment) -> dict[str, dict]:  # type: ignore[type-arg]
    return {c.id: experiment.cell_settings(c) for c in experiment.cells()}


def test_each_window_is_a_column_of_cells_with_its_own_rate_and_drain(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(MOONCAKE_SLICE.read_text())
    experiment = slice_experiment(path, HALVES)
    cells = experiment.cells()
    assert [c.id for c in cells] == [
        "honest/trace/ctx0_x1_w0+6",
        "honest/trace/ctx0_x2_w0+6",
        "honest/trace/ctx0_x1_w6+6",
        "honest/trace/ctx0_x2_w6+6",
    ]
    # Each window's rate over its stated length: 14 requests in the first 6 s (5,999 ms is inside), 3 in the next.
    assert [c.load.per_s for c in cells] == pytest.approx([14 / 6, 28 / 6, 3 / 6, 6 / 6])
    assert experiment.cell("honest", "trace", 0, "x2_w6+6") == cells[3]
    with pytest.raises(ConfigError, match="not in the grid"):
        experiment.cell("honest", "trace", 0, "x2")  # the whole trace is not one of its windows
    first, second = (experiment.cell_settings(cells[i])["workload"] for i in (0, 2))
    assert first["window"] == {"start_s": 0.0, "duration_s": 6.0} and first["trace"]["requests"] == 14
    # The drain: as many of the next arrivals as the client may hold (max_in_flight 2), the window's last ones being
    # lines 15-16 for the first half and 18-19 for the second.
    replayed = trace_source.replayed(first)
    assert [r.line for c in replayed.drain for r in c.turns] == [15, 16] and first["trace"]["drain_arrivals"] == 2
    assert [r.line for c in trace_source.replayed(second).drain for r in c.turns] == [18, 19]
    assert [r.line for r in replayed.sent.requests] == list(range(1, 17))
    assert experiment.cell_settings(cells[0])["open_loop"]["requests"] == 14  # what estimate and Slurm price
    # A label names its window and reads back as it.
    for window in (Window(), Window(600), Window(600, 300), Window(0.5, 12.25)):
        assert Window.from_label(window.label) == window
    assert [Window(600).label, Window(600, 300).label, Window().label] == ["w600", "w600+300", ""]


def test_a_trace_edited_outside_a_cells_window_and_drain_reruns_none_of_its_cells(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = MOONCAKE_SLICE.read_text().splitlines()
    path.write_text("\n".join(lines) + "\n")
    before = settings_by_cell(slice_experiment(path, HALVES))

    def edited(line: int) -> dict[str, dict]:  # type: ignore[type-arg]
        rows = [json.loads(text) for text in lines]
        rows[line - 1]["output_length"] += 1
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return settings_by_cell(slice_experiment(path, HALVES))

    def changed(after: dict[str, dict]) -> list[str]:  # type: ignore[type-arg]
        return [cell for cell in before if after[cell] != before[cell]]

    assert changed(edited(2)) == ["honest/trace/ctx0_x1_w0+6", "honest/trace/ctx0_x2_w0+6"]  # in the first half
    # Line 15 is the second half's, and the first half's drain: both halves' cells replay it.
    assert changed(edited(15)) == list(before)
    assert changed(edited(20)) == []  # after both windows and both drains
    # Another window adds its cells and changes none of the others.
    path.write_text("\n".join(lines) + "\n")
    widened = settings_by_cell(slice_experiment(path, [*HALVES, {"start_s": 3}]))
    assert {cell: widened[cell] for cell in before} == before
    assert sorted(set(widened) - set(before)) == ["honest/trace/ctx0_x1_w3", "honest/trace/ctx0_x2_w3"]


def test_a_window_listed_twice_or_empty_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"workloads.trace: windows: a window is listed twice"):
        slice_experiment(MOONCAKE_SLICE, [HALVES[0], dict(HALVES[0])])
    with pytest.raises(ConfigError, match=r"no request arrives in the window from 13 s for 5 s"):
        slice_experiment(MOONCAKE_SLICE, [{"start_s": 13, "duration_s": 5}])
    with pytest.raises(ConfigError, match=r"window w12 has no rate.*give the window a duration_s"):
        slice_experiment(MOONCAKE_SLICE, [{"start_s": 12}])  # three requests, all at one instant


def test_a_window_measures_its_own_arrivals_and_the_trace_after_it_keeps_the_load_on(sandbox, tmp_path):
    """A window in the middle of a generated trace, at 2x, on a calibration server that streams a token every 100 ms
    (so the window's last requests are still running when the next arrivals are due). Exactly the window's requests
    are measured; the arrivals after it go out on their own schedule as the drain, and none is measured."""
    source = {
        "generate": {
            "seed": 3,
            "duration_s": 12,
            "rate": 4,
            "input_median": 48,
            "output_median": 6,
            "max_input": 160,
            "max_output": 8,
            "session_share": 0,
            "burstiness": 4,
        }
    }
    experiment = trace_experiment(
        source, [2], windows=[{"start_s": 4, "duration_s": 4}], open_loop={"ramp_s": 0, "max_in_flight": 8}
    )
    raw = experiment.raw
    raw["configurations"]["honest"]["args"] = ["--interval", "0.1"]
    experiment = Experiment(raw)
    (cell,) = experiment.cells()
    assert cell.id == "honest/trace/ctx0_x2_w4+4"
    replayed = trace_source.replayed(experiment.cell_workload(cell))
    assert len(replayed.drain) == 8  # the next eight arrivals of the trace
    summary, requests = replay(experiment, sandbox, tmp_path)
    row = summary.iloc[0]
    assert bool(row["valid"]), row["invalid_reasons"]
    assert row["window"] == "w4+4" and row["load"] == "x2_w4+4"
    measured = requests[requests["phase"] == "measured"]
    drained = requests[requests["phase"] == "drain"]
    window_lines = [r.line for r in replayed.window.requests]
    sent = {i: c.turns[0] for i, c in enumerate(replayed.sent.conversations)}
    assert sorted(sent[int(s)].line for s in measured["seq"]) == window_lines  # the window, all of it, only it
    assert len(drained) > 0 and all(int(s) >= len(replayed.window.conversations) for s in drained["seq"])
    assert row["drain_requests"] == len(drained) and row["ramp_requests"] == 0
    assert drained["send_delay_s"].max() < 0.1  # on the trace's schedule, not after the window's answers
    first_ms = replayed.sent.conversations[0].arrival_ms
    for r in drained.itertuples():  # each at its own time in the trace, at 2x
        assert r.intended_send_s - measured["intended_send_s"].min() == pytest.approx(
            (sent[int(r.seq)].timestamp_ms - first_ms) / 2000, abs=0.002
        )
    # The window's offered rate, as the grid said: its requests over its 4 s, twice as fast.
    assert row["offered_rate"] == pytest.approx(len(window_lines) / 4 * 2)
