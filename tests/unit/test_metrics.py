"""Server metrics: vLLM's names across its generations (read by its engine), and the canonical deltas."""

from __future__ import annotations

import pytest

from helpers import REPO
from servegrid import engines
from servegrid.engines import metrics

DATA = REPO / "tests" / "data"


def parse(exposition: str, model_name: str) -> dict[str, float]:
    return engines.get("vllm").parse_metrics(exposition, model_name)


def test_current_names():
    values = parse((DATA / "metrics_vllm_0_32.txt").read_text(), model_name="tiny")
    assert values["prefix_cache_queries"] == 4352
    assert values["prefix_cache_hits"] == 4096
    assert values["kv_cache_usage_perc"] == 0.25
    assert values["num_requests_running"] == 2
    assert values["num_requests_waiting"] == 1  # the by-reason series is not double counted
    assert values["spec_decode_num_accepted_tokens"] == 12  # per-position series excluded
    assert "spec_decode_num_accepted_tokens_per_pos" not in values


def test_legacy_gpu_prefixed_names_sum_engines_and_filter_model():
    values = parse((DATA / "metrics_vllm_legacy.txt").read_text(), model_name="big")
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
    assert set(derived.values()) == {None}
    assert set(derived) == {
        "ttft_mean_s",
        "tpot_mean_s",
        "prefix_cache_hit_rate",
        "spec_acceptance_rate",
        "spec_mean_acceptance_length",
    }


def test_calibration_server_speaks_both_generations(calibration):
    import httpx

    from servegrid.testing.calibration import Script

    for legacy in (False, True):
        with calibration(Script(legacy_metric_names=legacy)) as srv:
            values = parse(httpx.get(f"{srv.url}/metrics").text, model_name="calibration")
        assert set(values) >= {"prefix_cache_queries", "prefix_cache_hits", "kv_cache_usage_perc"}


LATENCY_EXPOSITION = """\
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="tiny"} 2.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="tiny"} 0.5
vllm:time_to_first_token_seconds_count{engine="0",model_name="other"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="other"} 90.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 6.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 60.0
"""


def test_server_timing_sums_engines_for_the_served_model_only():
    values = parse(LATENCY_EXPOSITION, model_name="tiny")
    assert values["time_to_first_token_seconds_sum"] == 2.0  # both engines, not the other model
    assert values["time_to_first_token_seconds_count"] == 6
    assert not any(name.startswith("e2e_request_latency") for name in values)  # buckets and other histograms out
    assert "request_time_per_output_token_seconds_sum" not in values  # not exposed: absent, not zero


def test_server_timing_means_over_the_requests_between_two_scrapes():
    before = parse(LATENCY_EXPOSITION, model_name="tiny")
    after = before | {"time_to_first_token_seconds_sum": 3.2, "time_to_first_token_seconds_count": 10.0}
    figures = metrics.derived(metrics.delta(before, after))
    assert figures["ttft_mean_s"] == pytest.approx(0.3)
    assert figures["tpot_mean_s"] is None  # not exposed
    assert metrics.derived(metrics.delta(after, after))["ttft_mean_s"] is None  # no request ended
