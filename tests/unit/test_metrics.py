"""Prometheus parsing across vLLM metric-name generations."""

from __future__ import annotations

import pytest

from helpers import REPO
from servegrid import metrics

DATA = REPO / "tests" / "data"


def test_current_names():
    values = metrics.parse((DATA / "metrics_vllm_0_32.txt").read_text(), model_name="tiny")
    assert values["prefix_cache_queries"] == 4352
    assert values["prefix_cache_hits"] == 4096
    assert values["kv_cache_usage_perc"] == 0.25
    assert values["num_requests_running"] == 2
    assert values["num_requests_waiting"] == 1  # the by-reason series is not double counted
    assert values["spec_decode_num_accepted_tokens"] == 12  # per-position series excluded
    assert "spec_decode_num_accepted_tokens_per_pos" not in values


def test_legacy_gpu_prefixed_names_sum_engines_and_filter_model():
    values = metrics.parse((DATA / "metrics_vllm_legacy.txt").read_text(), model_name="big")
    assert values["prefix_cache_queries"] == 2000
    assert values["prefix_cache_hits"] == 800
    assert values["kv_cache_usage_perc"] == 0.5
    assert values["num_requests_running"] == 4  # "other" model ignored
    assert values["num_preemptions"] == 7
    assert "spec_decode_num_drafts" not in values


def test_delta_and_derived_figures():
    before = {
        "prefix_cache_queries": 100.0,
        "prefix_cache_hits": 0.0,
        "spec_decode_num_drafts": 10.0,
        "spec_decode_num_draft_tokens": 30.0,
        "spec_decode_num_accepted_tokens": 15.0,
    }
    after = {
        "prefix_cache_queries": 1100.0,
        "prefix_cache_hits": 900.0,
        "spec_decode_num_drafts": 20.0,
        "spec_decode_num_draft_tokens": 60.0,
        "spec_decode_num_accepted_tokens": 42.0,
    }
    delta = metrics.delta(before, after)
    assert delta["prefix_cache_queries"] == 1000 and delta["prefix_cache_hits"] == 900
    assert delta["num_preemptions"] is None  # not exposed: unknown, not zero
    derived = metrics.derived(delta)
    assert derived["prefix_cache_hit_rate"] == pytest.approx(0.9)
    assert derived["spec_acceptance_rate"] == pytest.approx(27 / 30)
    assert derived["spec_mean_acceptance_length"] == pytest.approx(1 + 27 / 10)


def test_derived_is_none_without_traffic():
    derived = metrics.derived(metrics.delta({}, {"prefix_cache_queries": 0.0, "prefix_cache_hits": 0.0}))
    assert derived == {"prefix_cache_hit_rate": None, "spec_acceptance_rate": None, "spec_mean_acceptance_length": None}


def test_calibration_server_speaks_both_generations(calibration):
    import httpx

    from servegrid.calibration import Script

    for legacy in (False, True):
        with calibration(Script(legacy_metric_names=legacy)) as srv:
            values = metrics.parse(httpx.get(f"{srv.url}/metrics").text, model_name="calibration")
        assert set(values) >= {"prefix_cache_queries", "prefix_cache_hits", "kv_cache_usage_perc"}
