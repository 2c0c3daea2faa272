"""The engine boundary, proven with a second engine: the calibration server in its own dialect.

:class:`~servegrid.testing.engine.CalibrationEngine` shares nothing on the wire
with vLLM: other endpoints, request fields, metric names and labels, start-up
log line, launch flags and API key variable. Real cells on it (server.ensure
launching the calibration server as a subprocess, cell.run_cell measuring, the
cell file written) come out right only if every part of servegrid reaches the
server through its engine.
"""

from __future__ import annotations

import inspect
import json
import os
import sys

import httpx
import pandas as pd
import pytest

from servegrid import engines
from servegrid.config import Experiment
from servegrid.engines import Engine, StartupFacts
from servegrid.engines.vllm import VLLMEngine
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import cell_file, cell_format
from servegrid.records.cell_record import CellRecord
from servegrid.serving import procs, server
from servegrid.testing import calibration as calibration_server
from servegrid.testing import dialect as calibration_dialect
from servegrid.testing.calibration import Script
from servegrid.testing.engine import CalibrationEngine  # importing it registers engine.kind "calibration"

KEY_VAR = "SERVEGRID_TEST_CALIBRATION_KEY"
KEY = "calibration-s3cret"
SPECULATIVE = {"method": "draft_model", "num_speculative_tokens": 3}


def calibration_experiment() -> Experiment:
    return Experiment(
        {
            "experiment": {"title": "engine boundary"},
            "model": {"path": "none", "served_name": "calibration"},
            "engine": {
                "kind": "calibration",
                "command": [sys.executable, "-m", "servegrid.testing.calibration", "--model", "{model}"],
                "args": ["--interval", "0.01"],
                "api_key_env": KEY_VAR,
            },
            "configurations": {
                "cached": {"label": "prefix caching", "prefix_caching": True},
                "speculative": {"label": "speculation", "prefix_caching": False, "speculative": SPECULATIVE},
            },
            "workloads": {
                "decode": {"contexts": [64], "concurrency": [2], "output_tokens": 8, "requests_per_session": 2},
                "single_turn": {"contexts": [512], "concurrency": [2], "suffix_tokens": 32, "output_tokens": 8},
                "multi_turn": {
                    "contexts": [128],
                    "concurrency": [2],
                    "turns": 3,
                    "tokens_per_turn": 64,
                    "output_tokens": 8,
                },
            },
            "operations": {"request_timeout_s": 30},
        }
    )


@pytest.fixture
def measure(sandbox, monkeypatch):  # type: ignore[no-untyped-def]
    """``measure(configuration, mode)``: run that cell for real; its measured rows and the stored metadata."""
    monkeypatch.setenv(KEY_VAR, KEY)
    experiment = calibration_experiment()

    def run(configuration: str, mode: str) -> tuple[pd.DataFrame, CellRecord]:
        (cell,) = [c for c in experiment.cells(configuration) if c.mode == mode]
        returned = run_cell(experiment, cell, cell.path, owner=procs.ProcessRef.of(os.getpid()), runtime=sandbox)
        table, meta = cell_file.read_cell(cell.path)
        # What the job returned is what the file holds, in today's format.
        assert meta.format_version == cell_format.FORMAT_VERSION
        assert json.dumps(meta.facts(), sort_keys=True) == json.dumps(returned.facts(), sort_keys=True)
        frame = table.to_pandas()
        return frame[frame["phase"] == "measured"], meta

    return run


def test_a_cell_on_the_second_engine_is_launched_driven_and_read_through_it(measure):
    rows, meta = measure("cached", "single_turn")
    assert len(rows) == 2 * 3 and rows["error"].isna().all()  # concurrency x requests_per_session (default 3)
    assert (rows["prompt_tokens_reported"] == 512 + 32).all() and (rows["output_tokens_reported"] == 8).all()

    facts = meta.server
    assert facts["engine"] == "calibration"
    argv = facts["argv"]
    assert argv[argv.index("--dialect") + 1] == "calibration" and "--listen" in argv
    assert "--host" not in argv and not set(VLLMEngine().feature_flags(True, SPECULATIVE)) & set(argv)
    # The key went to the server under the calibration dialect's variable; it is nowhere in the cell file.
    assert facts["env"] == {calibration_dialect.API_KEY_VAR: "***"}
    assert KEY not in json.dumps(meta.facts())
    # Read from its start-up log line and its info endpoint.
    assert facts["kv_cache_tokens"] == calibration_dialect.KV_POOL_TOKENS
    assert facts["max_concurrency"] == calibration_dialect.KV_POOL_SEQUENCES
    assert facts["engine_version"] == calibration_dialect.BUILD
    assert facts["block_size"] == calibration_dialect.KV_BLOCK_TOKENS
    assert facts["max_model_len"] == calibration_dialect.CONTEXT_LIMIT
    assert meta.cache_state == "reset"  # its own reset endpoint

    # The server's counters, under its own names, read back by CalibrationEngine.parse_metrics.
    server_metrics = meta.server_metrics
    assert server_metrics["delta"]["prompt_tokens"] == 6 * (512 + 32)
    assert server_metrics["delta"]["generation_tokens"] == 6 * 8
    assert server_metrics["derived"]["prefix_cache_hit_rate"] == pytest.approx(512 / 544)
    assert server_metrics["derived"]["ttft_mean_s"] > 0 and server_metrics["derived"]["tpot_mean_s"] > 0
    assert server_metrics["gauges"]["samples"] >= 1
    assert server_metrics["gauges"]["kv_cache_usage_perc_max"] is not None


def test_the_second_engines_feature_flags_switch_its_features(measure):
    rows, meta = measure("speculative", "decode")
    argv = meta.server["argv"]
    flags = CalibrationEngine().feature_flags(False, SPECULATIVE)
    assert argv[argv.index(flags[0]) :][: len(flags)] == flags
    assert rows["error"].isna().all()
    assert all(list(tokens) == [4, 4] for tokens in rows["chunk_tokens"])  # 3 draft tokens + 1 per step
    derived = meta.server_metrics["derived"]
    assert derived["spec_acceptance_rate"] == 1.0 and derived["spec_mean_acceptance_length"] == 4.0
    assert derived["prefix_cache_hit_rate"] == 0


def test_chat_turns_are_measured_with_the_second_engines_tokenizer(measure):
    rows, meta = measure("cached", "multi_turn")
    assert rows["error"].isna().all()
    assert sorted(rows["turn"].unique()) == [1, 2, 3]
    assert (rows["prompt_tokens_requested"] == rows["prompt_tokens_reported"]).all()
    assert (rows.loc[rows["turn"] == 1, "prompt_tokens_reported"] == 128).all()
    assert meta.server_metrics["derived"]["prefix_cache_hit_rate"] > 0.3


def _protocol() -> tuple[list[str], dict[str, inspect.Signature]]:
    attributes = list(Engine.__annotations__)
    methods = {
        name: inspect.signature(member)
        for name, member in vars(Engine).items()
        if callable(member) and not name.startswith("_")
    }
    return attributes, methods


@pytest.mark.parametrize("engine", [VLLMEngine(), CalibrationEngine()], ids=lambda e: e.kind)
def test_every_engine_has_every_member_of_the_protocol(engine):
    attributes, methods = _protocol()
    assert attributes and methods
    for name in attributes:
        assert isinstance(getattr(engine, name), str), name
    for name, declared in methods.items():
        assert list(inspect.signature(getattr(type(engine), name)).parameters) == list(declared.parameters), name
    assert engines.get(engine.kind).__class__ is type(engine)


def test_the_two_engines_share_nothing_on_the_wire():
    vllm, own = VLLMEngine(), CalibrationEngine()
    for path in ("health_path", "metrics_path", "completions_path", "chat_path"):
        assert getattr(vllm, path) != getattr(own, path)
    assert not set(vllm.feature_flags(False, SPECULATIVE)) & set(own.feature_flags(False, SPECULATIVE))
    assert not set(vllm.server_env({}, [], "k")) & set(own.server_env({}, [], "k"))
    assert vllm.completion_payload("m", [1], 4, 0.0).keys() != own.completion_payload("m", [1], 4, 0.0).keys()
    log_line = calibration_dialect.startup_line()
    assert vllm.startup_facts(log_line) == StartupFacts()
    assert own.startup_facts(log_line).kv_cache_tokens == calibration_dialect.KV_POOL_TOKENS


def test_each_engine_reads_its_own_metric_names_only(calibration):
    vllm, own = VLLMEngine(), CalibrationEngine()
    expositions = {}
    for dialect, engine in (("vllm", vllm), ("calibration", own)):
        with calibration(Script(), dialect=dialect) as srv:
            expositions[dialect] = httpx.get(f"{srv.url}{engine.metrics_path}").text
    wanted = {"prefix_cache_queries", "prefix_cache_hits", "kv_cache_usage_perc", "time_to_first_token_seconds_count"}
    assert set(own.parse_metrics(expositions["calibration"], "calibration")) >= wanted
    assert set(vllm.parse_metrics(expositions["vllm"], "calibration")) >= wanted
    assert own.parse_metrics(expositions["vllm"], "calibration") == {}
    assert vllm.parse_metrics(expositions["calibration"], "calibration") == {}
    assert own.parse_metrics(expositions["calibration"], "another model") == {}


def test_the_calibration_dialect_refuses_another_engines_flags(capsys):
    with pytest.raises(SystemExit) as exited:
        calibration_server.main(["--dialect", "calibration", *VLLMEngine().feature_flags(True, None)])
    assert exited.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_the_calibration_dialect_wants_its_key_everywhere_but_the_health_check(calibration):
    own = CalibrationEngine()
    with calibration(Script(), dialect="calibration", api_key="k") as srv:
        assert httpx.get(f"{srv.url}{own.health_path}").status_code == 200
        assert httpx.get(f"{srv.url}{own.metrics_path}").status_code == 401
        assert httpx.get(f"{srv.url}{own.metrics_path}", headers={"Authorization": "Bearer k"}).status_code == 200


def test_the_launch_command_comes_from_the_engine(monkeypatch):
    monkeypatch.setenv(KEY_VAR, KEY)
    spec = calibration_experiment().launch_spec("speculative")
    assert spec["engine"] == "calibration"
    argv, env = server.launch_command(spec, server.Runtime(host="127.0.0.1"), 8123)
    assert argv[:3] == [sys.executable, "-m", "servegrid.testing.calibration"]
    assert argv[argv.index("--listen") + 1] == "127.0.0.1:8123" and argv[argv.index("--name") + 1] == "calibration"
    assert env == {calibration_dialect.API_KEY_VAR: "***"}
