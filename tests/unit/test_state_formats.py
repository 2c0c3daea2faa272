"""Server state files and plans of every past format are read; a newer one is refused, never taken for ours.

Fixtures: tests/data/server-records/ (each folder the state a past commit's own cell run left; its README says
which) and tests/data/plans/.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import REPO
from servegrid.config import plan
from servegrid.errors import NewerFormatError
from servegrid.serving import state

RECORDS = REPO / "tests" / "data" / "server-records"
PLANS = REPO / "tests" / "data" / "plans"


def state_files() -> list[Path]:
    return sorted(RECORDS.rglob("*.json"))


@pytest.mark.parametrize("path", state_files(), ids=lambda p: str(p.relative_to(RECORDS)))
def test_each_past_state_file_is_read(path):
    content = state.read(path)
    assert content is not None and "format_version" not in content
    assert content.get("configuration", "honest") == "honest"
    if not path.name.endswith(state._NOT_RECORDS):  # a server record: its processes are long gone
        assert not state.live(content) and not state.anything_running(content)


def test_past_records_are_found_and_none_is_taken_for_a_running_server(tmp_path):
    for folder in sorted({p.parent for p in state_files()}):
        copy = tmp_path / folder.relative_to(RECORDS)
        shutil.copytree(folder, copy)
        (record,) = state.records_in(copy).values()
        assert record["configuration"] == "honest" and not state.supervised(record)


def test_todays_state_files_carry_their_format(tmp_path):
    path = tmp_path / "a.facts.json"
    state.write(path, {"configuration": "a"})
    assert json.loads(path.read_text())["format_version"] == state.STATE_FORMAT
    assert state.read(path) == {"configuration": "a"}


def test_a_state_file_of_a_newer_format_is_refused_and_its_server_left_alone(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"configuration": "a", "format_version": state.STATE_FORMAT + 1}))
    with pytest.raises(NewerFormatError, match=r"a\.json: a server state file of format 3, written by a newer"):
        state.read(path)
    assert state.records_in(tmp_path) == {}  # never stopped or reused by this servegrid


def test_a_plan_of_the_first_format_is_read(tmp_path):
    (fixture,) = PLANS.glob("*.json")
    identifier = fixture.stem.rsplit("-", 1)[1]
    target = plan.plan_path(identifier, tmp_path)
    target.parent.mkdir(parents=True)
    shutil.copyfile(fixture, target)
    planned = plan.read(identifier, tmp_path)
    assert planned["configurations"] == {"honest": {"label": "honest", "prefix_caching": True}}


def test_todays_plan_carries_its_format_and_reads_back(tmp_path):
    config = json.loads((REPO / "tests" / "data" / "cells" / "make" / "basic.json").read_text())
    identifier = plan.write(config, tmp_path)
    written = json.loads(plan.plan_path(identifier, tmp_path).read_text())
    assert written["format_version"] == plan.PLAN_FORMAT and written["config"] == config
    assert plan.read(identifier, tmp_path) == config


def test_a_plan_of_a_newer_format_is_refused_saying_so(tmp_path):
    config = {"experiment": {"title": "x"}}
    identifier = plan.plan_id(config)
    path = plan.plan_path(identifier, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format_version": plan.PLAN_FORMAT + 1, "config": config}))
    with pytest.raises(NewerFormatError, match="a plan of format 3, written by a newer servegrid"):
        plan.read(identifier, tmp_path)
