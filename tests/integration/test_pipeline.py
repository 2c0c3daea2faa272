"""The whole pipeline on real vLLM: Snakemake, two CPU servers, a tiny grid, the report."""

from __future__ import annotations

import re

import pandas as pd
import psutil
import pytest
import yaml

from helpers import REPO, copy_workflow, snakemake, write_yaml
from servegrid.records import CELL_SCHEMA

pytestmark = [pytest.mark.vllm, pytest.mark.pipeline]


def tiny_grid(demo_raw):  # type: ignore[no-untyped-def]
    raw = dict(demo_raw)
    raw["workloads"] = {
        "decode": {"contexts": [256], "concurrency": [1, 2], "output_tokens": 32, "requests_per_session": 2},
        "single_turn": {"contexts": [512], "concurrency": [2], "suffix_tokens": 32, "output_tokens": 8},
        "multi_turn": {"contexts": [256], "concurrency": [1], "turns": 2, "tokens_per_turn": 64, "output_tokens": 8},
    }
    return raw


def servers_of(workdir) -> list[psutil.Process]:  # type: ignore[no-untyped-def]
    """Live processes started from this workflow copy (vLLM keeps the model path in its command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "vllm" in cmdline and str(workdir) in cmdline:
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):  # type: ignore[no-untyped-def]
    workdir = copy_workflow(tmp_path_factory.mktemp("pipeline"))
    demo_raw = yaml.safe_load((REPO / "config" / "cpu-demo.yaml").read_text())
    raw = tiny_grid(demo_raw)
    raw["model"]["path"] = str(workdir / "results" / "model" / "tiny-qwen3")  # absolute: visible in ps
    write_yaml(workdir / "test.yaml", raw)
    result = snakemake(workdir, "--cores", "1", "report", "--configfile", "test.yaml")
    return workdir, result


def test_first_run_builds_everything(pipeline_run):
    workdir, result = pipeline_run
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for lang in ("pt", "hu"):
        for ext in ("html", "pdf"):
            assert (workdir / "results" / "report" / f"servegrid-{lang}.{ext}").stat().st_size > 10_000
    assert servers_of(workdir) == []


def test_parquet_tables_hold_exact_measured_requests_of_both_configurations(pipeline_run):
    workdir, _ = pipeline_run
    requests = pd.read_parquet(workdir / "results" / "tables" / "requests.parquet")
    assert set(CELL_SCHEMA.names) <= set(requests.columns)
    assert {"ttft_s", "tpot_s", "e2e_s", "decode_tps", "valid"} <= set(requests.columns)
    measured = requests[requests["phase"] == "measured"]
    assert set(measured["configuration"]) == {"prefix_cache", "ngram"}
    assert measured["valid"].all()
    assert (measured["prompt_tokens_reported"] == measured["prompt_tokens_requested"]).all()
    assert (measured["output_tokens_reported"] == measured["output_tokens_requested"]).all()
    summary = pd.read_parquet(workdir / "results" / "tables" / "summary.parquet")
    assert len(summary) == 2 * (2 + 1 + 1)
    assert summary["valid"].all()
    decode = summary[summary["mode"] == "decode"]
    assert decode["ttft_s_p50"].gt(0).all() and decode["tpot_s_p50"].gt(0).all()
    assert decode["decode_tps_p50"].gt(0).all()


def test_report_verdict_comes_from_this_runs_data(pipeline_run):
    workdir, _ = pipeline_run
    comparisons = pd.read_parquet(workdir / "results" / "tables" / "comparisons.parquet")
    html = (workdir / "results" / "report" / "servegrid-pt.html").read_text()
    verdict = html.split('id="verdict"')[1].split("</section>")[0]
    assert verdict.count("<tr>") == 1 + len(comparisons)
    for factor in comparisons["factor"]:
        assert f"{factor:.1f}".replace(".", ",") + "×" in verdict
    assert "vLLM 0.32.0" in html


def test_servers_were_started_once_each_and_logged(pipeline_run):
    workdir, _ = pipeline_run
    logs = sorted((workdir / "results" / "servers").glob("*/logs/*[0-9a-f].log"))
    assert [p.parts[-3] for p in logs] == ["ngram", "prefix_cache"]
    for log in logs:
        assert "Application startup complete" in log.read_text()
    stop_records = sorted((workdir / "results" / "servers").glob("*/stopped.json"))
    assert len(stop_records) == 2


def test_second_run_does_nothing_and_starts_no_server(pipeline_run):
    workdir, _ = pipeline_run
    dry = snakemake(workdir, "-n", "--cores", "1", "report", "--configfile", "test.yaml")
    assert dry.returncode == 0
    assert "Nothing to be done" in dry.stdout + dry.stderr
    logs_before = set((workdir / "results" / "servers").glob("*/logs/*"))
    again = snakemake(workdir, "--cores", "1", "report", "--configfile", "test.yaml")
    assert again.returncode == 0
    assert set((workdir / "results" / "servers").glob("*/logs/*")) == logs_before
    assert not re.search(r"rule (cell|server_spec):", again.stdout + again.stderr)
