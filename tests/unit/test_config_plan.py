"""The config a run planned with (servegrid.config.plan): written once, read back exactly, edits named by key."""

from __future__ import annotations

import json

import pytest

from servegrid.config import plan
from servegrid.errors import ConfigError

PLANNED = {
    "workloads": {"decode": {"contexts": [1024, 4096], "output_tokens": 256}},
    "configurations": {"mtp": {"args": ["--speculative-config", "{}"]}},
}


def test_a_plan_is_written_once_and_read_back_as_planned(tmp_path):
    identifier = plan.write(PLANNED, tmp_path)
    assert plan.write(json.loads(json.dumps(PLANNED)), tmp_path) == identifier  # the same config, the same plan
    assert plan.read(identifier, tmp_path) == PLANNED
    assert [p.name for p in plan.plan_path(identifier, tmp_path).parent.iterdir()] == [f"{identifier}.json"]


def test_each_edit_is_named_by_its_key():
    edited = json.loads(json.dumps(PLANNED))
    assert plan.first_difference(PLANNED, edited) is None
    edited["workloads"]["decode"]["output_tokens"] = 512
    assert plan.first_difference(PLANNED, edited) == "workloads.decode.output_tokens: planned 256, now 512"
    edited = json.loads(json.dumps(PLANNED))
    edited["workloads"]["decode"]["contexts"][1] = 8192
    assert plan.first_difference(PLANNED, edited) == "workloads.decode.contexts[1]: planned 4096, now 8192"
    edited["workloads"]["decode"]["contexts"].append(16384)
    assert plan.first_difference(PLANNED, edited) == (
        "workloads.decode.contexts: planned [1024,4096], now [1024,8192,16384]"
    )
    del edited["configurations"]["mtp"]
    assert plan.first_difference(PLANNED, edited) == (
        'configurations.mtp: planned {"args":["--speculative-config","{}"]}, now absent'
    )
    assert plan.first_difference({}, {"sampling": {"temperature": 0.0}}) == (
        'sampling: absent when planned, now {"temperature":0.0}'
    )


def test_a_plan_that_is_gone_or_altered_is_refused_naming_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"results/\.plans/0123456789abcdef\.json: the config this job was planned"):
        plan.read("0123456789abcdef", tmp_path)
    identifier = plan.write(PLANNED, tmp_path)
    path = plan.plan_path(identifier, tmp_path)
    path.write_text(json.dumps({**PLANNED, "workloads": {}}))
    with pytest.raises(ConfigError, match="does not hold the config its name says"):
        plan.read(identifier, tmp_path)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot be read"):
        plan.read(identifier, tmp_path)


def test_the_note_lists_a_few_edits_and_counts_the_rest():
    now = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}
    assert plan.summary({}, {}) is None
    assert plan.summary({**now, "a": 0}, now) == "a: planned 0, now 1"
    assert plan.summary({k: 0 for k in now}, now) == (
        "a: planned 0, now 1; b: planned 0, now 2; c: planned 0, now 3; and 2 more"
    )
