"""The gateway's config, its generated LiteLLM config, decoding a stream counted by chunk, and its cost table.

The real LiteLLM proxy in front of the real vLLM server is tests/integration/test_gateway.py.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from helpers import with_changes
from servegrid.analysis import gateway_cost
from servegrid.config import Experiment
from servegrid.errors import ConfigError
from servegrid.measuring import measured_phase
from servegrid.measuring.client import decode_counted_by_chunk, decode_into
from servegrid.records import cell_file
from servegrid.records.request import RequestRecord
from servegrid.serving import gateway

PROXY = {"version": "1.106.12"}


def proxied(demo_raw, **changes):  # type: ignore[no-untyped-def]
    return Experiment(with_changes(demo_raw, route="both", proxy=dict(PROXY), **changes), source="demo.yaml")


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"route": "proxy"}, "route: 'proxy' goes through a gateway, but there is no proxy"),
        ({"route": "both", "proxy": {"version": "1.82.7"}}, "proxy.version: LiteLLM 1.82.7 was published"),
        ({"route": "both", "proxy": {"version": "1.82.8"}}, "proxy.version: LiteLLM 1.82.8"),
        ({"route": "both", "proxy": {"args": ["--port", "9"]}}, "proxy.args: '--port' is set by servegrid"),
        (
            {"route": "both", "proxy": {"url": "http://127.0.0.1:4000", "models": {"nope": "x"}}},
            "proxy.models: no configuration named nope",
        ),
        ({"route": "both", "proxy": {"model_params": {"api_key": "sk-live"}}}, "proxy.model_params.api_key"),
        ({"route": "sideways", "proxy": {}}, "route"),
    ],
)
def test_bad_gateway_settings_name_the_key(demo_raw, changes, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Experiment(with_changes(demo_raw, **changes), source="demo.yaml")


def test_a_direct_run_keeps_its_cell_settings_and_a_proxied_one_names_the_gateway(demo_raw):
    direct, both = Experiment(demo_raw), proxied(demo_raw)
    cell = direct.cells()[0]
    assert "route" not in direct.cell_settings(cell)  # adding the gateway reran nothing measured directly
    settings = both.cell_settings(cell)
    assert settings["route"] == "both" and settings["gateway"]["version"] == "1.106.12"
    newer = proxied(demo_raw, **{"proxy.version": "1.106.11"})
    assert newer.cell_settings(cell) != settings  # another LiteLLM reruns the proxied cells
    moved = proxied(demo_raw, **{"proxy.port": 4100, "proxy.master_key_env": "OTHER_KEY"})
    assert moved.cell_settings(cell) == settings  # placement and the key's variable rerun nothing
    assert both.routes() == ["direct", "proxy"] and direct.routes() == ["direct"]


def test_the_generated_litellm_config_holds_no_secret(demo_raw, monkeypatch):
    experiment = proxied(demo_raw, **{"engine.api_key_env": "UPSTREAM_KEY", "proxy.model_params": {"timeout": 600}})
    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream-secret")
    monkeypatch.setenv("SERVEGRID_PROXY_KEY", "sk-master-secret")
    config = gateway.proxy_config(experiment, {"ngram": "http://127.0.0.1:8101"}, "servegrid-SESSION")
    text = json.dumps(config)
    assert "secret" not in text
    assert config["general_settings"]["master_key"] == "os.environ/SERVEGRID_PROXY_KEY"
    first, identity = config["model_list"]
    assert first["model_name"] == "ngram" and identity["model_name"] == "servegrid-SESSION"
    assert first["litellm_params"] == {
        "model": "openai/tiny-qwen3",  # hosted_vllm/ refuses token-id prompts
        "api_key": "os.environ/UPSTREAM_KEY",
        "api_base": "http://127.0.0.1:8101/v1",
        "timeout": 600,
    }
    assert gateway.headers(experiment.proxy) == {"Authorization": "Bearer sk-master-secret"}


def test_a_missing_master_key_is_named(demo_raw, monkeypatch):
    monkeypatch.delenv("SERVEGRID_PROXY_KEY", raising=False)
    with pytest.raises(gateway.GatewayError, match="SERVEGRID_PROXY_KEY"):
        gateway.headers(proxied(demo_raw).proxy)


def _sse(*events: dict) -> bytes:  # type: ignore[type-arg]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _litellm_stream(pieces: list[str], prompt: int, total: int) -> tuple[bytes, list[tuple[int, int]]]:
    """A stream as LiteLLM re-frames vLLM's: a role chunk, text chunks without usage, a final usage chunk."""
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{"choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}]
    events += [{"choices": [{"index": 0, "delta": {}}], "usage": {"prompt_tokens": prompt, "completion_tokens": total}}]
    raw, reads, offset = b"", [], 0
    for i, event in enumerate(events):  # one read per event, 1 ms apart
        chunk = _sse(event)[: -len(b"data: [DONE]\n\n")]
        raw += chunk
        offset += len(chunk)
        reads.append((1_000_000 * (i + 1), offset))
    raw += b"data: [DONE]\n\n"
    reads.append((1_000_000 * (len(events) + 1), len(raw)))
    return raw, reads


def test_a_stream_without_running_counts_is_timed_by_chunk():
    raw, reads = _litellm_stream(["a", "b", "c", "d"], prompt=100, total=4)
    record = RequestRecord("r", 0, 0, "measured", 1, 100, 4, sent_ns=0)
    decode_into(raw, reads, record, per_chunk_usage=False)
    assert record.error is None
    assert record.chunk_tokens == [1, 1, 1, 1] and record.chunk_tokens_exact
    assert record.chunk_ns[0] == 2_000_000  # the first text, not the empty role chunk
    assert (record.prompt_tokens_reported, record.output_tokens_reported) == (100, 4)
    assert record.finish_reason == "length" and record.text == "abcd"


def test_fewer_chunks_than_tokens_are_spread_and_flagged():
    raw, reads = _litellm_stream(["ab", "cde", "f"], prompt=10, total=8)
    record = RequestRecord("r", 0, 0, "measured", 1, 10, 8, sent_ns=0)
    decode_counted_by_chunk(raw, reads, record)
    assert sum(record.chunk_tokens) == 8 and record.chunk_tokens[0] == 1
    assert record.chunk_tokens_exact is False
    # The strict decoder (direct to vLLM) refuses the same stream: its text carries no count.
    strict = RequestRecord("r", 0, 0, "measured", 1, 10, 8, sent_ns=0)
    decode_into(raw, reads, strict)
    assert strict.error and "no usage.completion_tokens" in strict.error


def test_routes_alternate_between_repeats():
    routes = [measured_phase.Route("direct", "u", "m"), measured_phase.Route("proxy", "g", "c")]
    assert [r.name for r in measured_phase.route_order(routes, 0)] == ["direct", "proxy"]
    assert [r.name for r in measured_phase.route_order(routes, 1)] == ["proxy", "direct"]


def test_request_ids_stay_unique_across_routes():
    def record(route: str) -> RequestRecord:
        r = RequestRecord("measured-s0-r0-t1", 0, 0, "measured", 1, 8, 8, route=route)
        return r

    ids = cell_file.rows([record("direct"), record("proxy")])["request_id"]
    assert ids == ["r0-measured-s0-r0-t1", "r0-proxy-measured-s0-r0-t1"]  # direct ids as before routes


def _requests(shift_s: float, n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    base = rng.normal(0.100, 0.005, n)
    return pd.DataFrame(
        {
            "configuration": "a",
            "mode": "decode",
            "context": 512,
            "concurrency": 1,
            "rate": 0.0,
            "phase": "measured",
            "valid": True,
            "ttft_s": base + shift_s,
            "tpot_s": base / 10 + shift_s / 10,
            "e2e_s": base * 3 + shift_s,
            "chunk_tokens_exact": True,
        }
    )


def test_the_added_latency_is_the_shift_with_an_interval_around_it():
    direct, through = _requests(0.0, 400, 1), _requests(0.020, 400, 2)
    stream_check = {"per_chunk_usage": False, "chunks_direct": 16, "chunks_proxy": 16, "same_text": True}
    check = {("a", "decode", 512, 1, 0.0, ""): {"check": stream_check, "facts": {"version": "1.106.12"}}}
    (row,) = gateway_cost.added_latency(direct, through, check).to_dict("records")
    assert row["ttft_added_p50_ci_low_s"] < row["ttft_added_p50_s"] < row["ttft_added_p50_ci_high_s"]
    assert 0.017 < row["ttft_added_p50_s"] < 0.023
    assert row["ttft_added_p50_ci_low_s"] > 0.010  # clearly above zero
    assert row["ttft_added_p99_s"] is not None  # 400 requests a side: enough for a p99
    assert row["per_chunk_usage"] is False and row["gateway_version"] == "1.106.12"
    few = gateway_cost.added_latency(direct.head(20), through.head(20), {}).iloc[0]
    assert few["ttft_added_p99_s"] is None or np.isnan(few["ttft_added_p99_s"])


def test_a_changed_verdict_is_flagged():
    direct = pd.DataFrame({"class_id": ["decode", "single"], "outcome": ["win", "win"], "winner": ["a", "b"]})
    through = pd.DataFrame({"class_id": ["decode", "single"], "outcome": ["win", "tie"], "winner": ["a", None]})
    changes = gateway_cost.verdict_changes(direct, through).set_index("class_id")
    assert not changes.loc["decode", "changed"] and changes.loc["single", "changed"]


def test_the_run_summary_says_what_the_gateway_added(demo_raw, tmp_path, monkeypatch):
    from servegrid import paths
    from servegrid.reporting import terminal_summary

    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "tables").mkdir(parents=True)
    rows = [
        {"concurrency": c, "ttft_added_p50_s": t, "tpot_added_p50_s": 0.0005, "e2e_added_p50_s": t + 0.01}
        for c, t in ((1, 0.050), (1, 0.070), (4, 0.250))
    ]
    pd.DataFrame(rows).to_parquet(paths.GATEWAY_TABLE)
    changes = pd.DataFrame([{"class_id": "decode", "changed": True}, {"class_id": "single_turn", "changed": False}])
    changes.to_parquet(paths.GATEWAY_VERDICT_TABLE)
    lines = terminal_summary._gateway_lines(proxied(demo_raw))
    assert "  TTFT: 1 x: +60.0 ms [+50.0, +70.0]; 4 x: +250.0 ms [+250.0, +250.0]" in lines
    assert lines[-1] == "  verdict changed through it: Decode, cold prompts"
    assert terminal_summary._gateway_lines(Experiment(demo_raw)) == []  # a direct run says nothing of it
