"""Trace replay (servegrid.modes.trace): the formats (a real Mooncake slice, CSV), errors naming the line, the seeded
generator, the grid's speedup axis and the trace's hash in the cells' identity, block-exact prompts, and a replay
against the calibration server: token-exact requests on the trace's schedule, a session's turns in order, and the
prefix-cache hit rate the server counts equal to the trace's own reuse in the server's blocks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_cell_flags import calibration_experiment

from servegrid.analysis import aggregation
from servegrid.config import Experiment
from servegrid.engines.base import PrefixCache
from servegrid.errors import ConfigError
from servegrid.modes import trace_source
from servegrid.modes.prompts import PromptBuilder
from servegrid.modes.trace import reusable_tokens
from servegrid.modes.trace_file import parse_mooncake
from servegrid.modes.trace_generator import TraceShape, generate
from servegrid.modes.trace_prompts import BlockPrompts
from servegrid.paths import RunTables
from servegrid.pipeline.cell_job import run_cell
from servegrid.records import cell_file
from servegrid.records.per_request import derive
from servegrid.serving import procs

MOONCAKE_SLICE = Path(__file__).parents[1] / "data" / "traces" / "mooncake_conversation_head.jsonl"


def trace_experiment(source: dict, speedups: list[float], block_tokens: int = 16, **extra: object) -> Experiment:  # type: ignore[type-arg]
    raw = calibration_experiment().raw
    raw["configurations"] = {"honest": {"label": "honest", "prefix_caching": True}}
    raw["workloads"] = {
        "trace": {
            "source": source,
            "block_tokens": block_tokens,
            "speedups": speedups,
            "open_loop": {"ramp_s": 0},
            **extra,
        },
    }
    return Experiment(raw)


# ---- formats -------------------------------------------------------------------------------------------------------


def test_a_slice_of_the_public_mooncake_trace_parses_as_the_format_says():
    trace = parse_mooncake(MOONCAKE_SLICE, 512)
    assert len(trace.requests) == 20 and len(trace.conversations) == 20
    assert all(r.hash_ids[0] == 0 for r in trace.requests)  # the trace's shared system prompt
    assert trace.span_s == 12.0 and trace.rate == pytest.approx(19 / 12)
    # Block 0 is carried by every request: each later one can reuse 512 tokens of it.
    reuse = reusable_tokens(trace, PrefixCache(block=16))
    assert reuse[(0, 1)] == 0 and all(reuse[(i, 1)] == 512 for i in range(1, 20))
    with pytest.raises(ConfigError, match=r"mooncake_conversation_head.jsonl:1: input_length 6758 needs 53 block"):
        parse_mooncake(MOONCAKE_SLICE, 128)  # not the trace's block size


def test_trace_lines_that_cannot_be_replayed_are_refused_naming_the_line(tmp_path):
    bad = tmp_path / "t.jsonl"
    cases = {
        (
            '{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\n{"timestamp": 1, "input_length": 10}'
        ): r"t.jsonl:2: no hash_ids",
        '{"timestamp": 0, "input_length": 10, "hash_ids": [1]}\nnot json': r"t.jsonl:2: not JSON",
        '{"timestamp": -5, "input_length": 10, "hash_ids": [1]}': r"t.jsonl:1: timestamp -5",
        '{"input_length": 10, "hash_ids": [1]}': r"t.jsonl:1: no timestamp",
        '{"timestamp": 0, "text_input": "hi", "input_length": 1, "hash_ids": [1]}': r"t.jsonl:1: text_input",
    }
    for text, message in cases.items():
        bad.write_text(text + "\n")
        with pytest.raises(ConfigError, match=message):
            parse_mooncake(bad, 16)


def test_a_csv_from_a_gateway_becomes_blocks_that_share_what_its_rows_say(tmp_path):
    path = tmp_path / "gateway.csv"
    path.write_text(
        "timestamp,input_tokens,output_tokens,session,prefix_group\n"
        "0,40,4,,sys\n"  # system prompt group: its shortest request's whole blocks (32 tokens) are shared
        "100,70,4,,sys\n"
        "200,20,4,chat,\n"  # a conversation: turn 2 starts with turn 1's whole blocks
        "900,50,4,chat,\n"
        "300,33,4,,\n"
    )
    trace = trace_source.read(path, block_tokens=16)
    by_line = {r.line: r for r in trace.requests}
    assert by_line[2].hash_ids[:2] == by_line[3].hash_ids[:2] and by_line[2].hash_ids[2] != by_line[3].hash_ids[2]
    assert by_line[5].hash_ids[:1] == by_line[4].hash_ids[:1] and len(by_line[5].hash_ids) == 4
    assert not set(by_line[6].hash_ids) & {h for r in trace.requests if r.line != 6 for h in r.hash_ids}
    # The conversation arrives once, with both turns; arrivals keep the timestamps' order.
    assert [len(c.turns) for c in trace.conversations] == [1, 1, 2, 1]
    path.write_text("timestamp,input_tokens,output\n0,1,1\n")
    with pytest.raises(ConfigError, match=r"gateway.csv:1: header .* missing output_tokens"):
        trace_source.read(path, block_tokens=16)


def test_the_generated_trace_is_seeded_bursty_long_tailed_and_shares_prefixes():
    shape = TraceShape(seed=3, duration_s=300, rate=4.0, burstiness=0.5)
    rows = generate(shape, 64)
    assert rows == generate(shape, 64)  # the same settings, the same trace
    assert rows != generate(TraceShape(seed=4, duration_s=300, rate=4.0, burstiness=0.5), 64)
    arrivals = np.array([r["timestamp"] for r in rows if "timestamp" in r], dtype=float)
    gaps = np.diff(arrivals)
    assert gaps.std() / gaps.mean() == pytest.approx(
        2**0.5, rel=0.15
    )  # gamma of shape 0.5: CV √2, burstier than Poisson
    prompts = np.array([r["input_length"] for r in rows])
    assert np.percentile(prompts, 99) > 3 * np.median(prompts)  # a long tail
    sessions = [r for r in rows if "session_id" in r]
    assert any("delay" in r for r in sessions) and len({r["session_id"] for r in sessions}) > 10
    trace = trace_source.from_rows(enumerate(rows, start=1), 64, "generated")
    share = sum(reusable_tokens(trace, PrefixCache()).values()) / prompts.sum()
    assert 0.1 < share < 0.9  # system prompts and conversations reuse a part of the prompts, not all


# ---- the grid and the cells' identity ------------------------------------------------------------------------------


def test_speedups_name_trace_cells_and_the_traces_content_is_their_identity(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(MOONCAKE_SLICE.read_text())
    experiment = trace_experiment({"file": str(path)}, [0.5, 2], block_tokens=512)
    cells = experiment.cells()
    assert [c.id for c in cells] == ["honest/trace/ctx0_x0.5", "honest/trace/ctx0_x2"]
    assert [c.load.per_s for c in cells] == pytest.approx([19 / 12 * 0.5, 19 / 12 * 2])
    assert experiment.cell("honest", "trace", 0, "x2") == cells[1]
    with pytest.raises(ConfigError, match="not in the grid"):
        experiment.cell("honest", "trace", 0, "x3")
    settings = experiment.cell_settings(cells[0])
    assert settings["speedup"] == 0.5 and settings["workload"]["trace"]["requests"] == 20
    # A changed request (one output length) is a new trace: the trace's cells rerun; the same requests reformatted
    # (keys reordered, spaces) are not.
    lines = MOONCAKE_SLICE.read_text().splitlines()
    path.write_text("\n".join(json.dumps(dict(reversed(json.loads(line).items()))) for line in lines) + "\n")
    assert trace_experiment({"file": str(path)}, [0.5, 2], block_tokens=512).cell_settings(cells[0]) == settings
    edited = [json.loads(line) for line in lines]
    edited[4]["output_length"] += 1
    path.write_text("".join(json.dumps(r) + "\n" for r in edited))
    assert trace_experiment({"file": str(path)}, [0.5, 2], block_tokens=512).cell_settings(cells[0]) != settings


def test_a_trace_request_longer_than_the_context_limit_is_refused_before_anything_runs(tmp_path):
    raw = trace_experiment({"file": str(MOONCAKE_SLICE)}, [1], block_tokens=512).raw
    raw["engine"]["args"] = ["--max-model-len", "8192"]
    with pytest.raises(
        ConfigError, match=r"mooncake_conversation_head.jsonl:7 holds 10900 tokens .* more than the 8192"
    ):
        Experiment(raw)
    raw["workloads"]["trace"]["windows"] = [{"start_s": 3, "duration_s": 2.5}]  # lines 8-11: none too long
    raw["workloads"]["trace"]["open_loop"] = {"max_in_flight": 2}  # its drain: lines 12-13, not too long either
    assert [c.id for c in Experiment(raw).cells()] == ["honest/trace/ctx0_x1_w3+2.5"]
    raw["workloads"]["trace"]["open_loop"] = {"max_in_flight": 64}  # a drain that reaches line 17 (8,773 tokens)
    with pytest.raises(ConfigError, match=r"mooncake_conversation_head.jsonl:17 holds 8773 tokens"):
        Experiment(raw)
    raw["workloads"]["trace"]["open_loop"] = {"max_in_flight": 2}
    raw["workloads"]["trace"]["source"] = {"file": str(MOONCAKE_SLICE), "generate": {}}
    with pytest.raises(ConfigError, match=r"give either file .* or generate"):
        Experiment(raw)


def test_block_prompts_share_exactly_the_blocks_their_ids_share():
    vocabulary: dict[str, int] = {}

    def tokenize(text: str) -> list[int]:  # a word-level tokenizer: enough for lengths and identity
        return [vocabulary.setdefault(word, len(vocabulary)) for word in text.split()] or [0]

    prompts = BlockPrompts(PromptBuilder(tokenize, seed=1, corpus_tokens=2000), block_tokens=32)
    trace = trace_source.from_rows(
        enumerate(
            [
                {"timestamp": 0, "input_length": 90, "hash_ids": [5, 6, 7]},
                {"timestamp": 1, "input_length": 70, "hash_ids": [5, 6, 8]},
                {"timestamp": 2, "input_length": 20, "hash_ids": [9]},
            ],
            start=1,
        ),
        32,
        "t",
    )
    a, b, c = (prompts.prompt(r) for r in trace.requests)
    assert [len(a), len(b), len(c)] == [90, 70, 20]
    assert a[:64] == b[:64] and a[64] != b[64]  # two shared blocks, then each its own
    assert a[:20] != c and c == prompts.block(9)[:20]  # another first block; a partial block is the block's start
    # Another cell run (a new nonce): none of its blocks is one of these, so nothing an earlier cell left can hit.
    assert BlockPrompts(prompts.builder.fresh(), block_tokens=32).block(5) != prompts.block(5)


# ---- replayed against the calibration server -----------------------------------------------------------------------


def replay(experiment: Experiment, sandbox, tmp_path) -> tuple[pd.DataFrame, pd.DataFrame]:  # type: ignore[no-untyped-def]
    owner = procs.ProcessRef.of(os.getpid())
    cells = experiment.cells()
    for cell in cells:
        run_cell(experiment, cell, cell.path, owner=owner, runtime=sandbox)
    tables = RunTables.under(tmp_path / "tables")
    summary = aggregation.aggregate(experiment, [c.path for c in cells], tables)
    requests = pd.concat([derive(cell_file.read_cell(c.path)[0].to_pandas()) for c in cells])
    return summary, requests


def test_a_replay_is_token_exact_on_schedule_and_hits_the_cache_as_the_trace_reuses(sandbox, tmp_path):
    """The generated trace (system prompts and conversations) at 4× its pace; the calibration server caches in
    16-token blocks as vLLM does. Every request carries exactly its trace length and output, goes out on time
    (a session's later turn after its answer plus the delay), and the hit rate the server counts is the trace's
    own reuse counted in the server's blocks."""
    source = {
        "generate": {
            "seed": 11,
            "duration_s": 8,
            "rate": 3,
            "input_median": 96,
            "output_median": 4,
            "max_input": 400,
            "max_output": 8,
            "think_mean_s": 0.3,
        }
    }
    experiment = trace_experiment(source, [4], block_tokens=32)
    summary, requests = replay(experiment, sandbox, tmp_path)
    row = summary.iloc[0]
    assert row["load"] == "x4" and row["speedup"] == 4 and bool(row["valid"]), row["invalid_reasons"]
    trace = trace_source.replayed(experiment.cell_workload(experiment.cells()[0])).window
    measured = requests[requests["phase"] == "measured"]
    assert len(measured) == len(trace.requests) and measured["error"].isna().all()
    expected = {(i, t): r for i, c in enumerate(trace.conversations) for t, r in enumerate(c.turns, start=1)}
    for r in measured.itertuples():
        want = expected[(int(r.seq), int(r.turn))]
        assert (r.prompt_tokens_reported, r.output_tokens_reported) == (want.input_tokens, want.output_tokens)
    first = measured[measured["turn"] == 1]
    assert first["send_delay_s"].max() < 0.1
    later = measured[measured["turn"] > 1].sort_values(["seq", "turn"])
    for r in later.itertuples():
        before = measured[(measured["seq"] == r.seq) & (measured["turn"] == r.turn - 1)].iloc[0]
        want = expected[(int(r.seq), int(r.turn))]
        assert r.sent_s >= before["end_s"] + want.delay_ms / 4 / 1000 - 0.001  # never before its answer + delay
    # Exact here (this server counts a block when the request arrives); one token out of place misses ~0.025.
    assert row["server_prefix_cache_hit_rate"] == pytest.approx(row["expected_hit_rate"], abs=0.005)
    assert row["expected_hit_rate"] > 0.2 and not bool(row["cache_contradiction"])


def test_the_report_shows_what_was_replayed_and_the_speedups_each_configuration_sustains(sandbox, tmp_path):
    """Two speedups of a small generated trace: the trace's section shows its shape figure, the open-loop section
    names each cell by its speedup and the verdict says up to which speedup the configuration kept up, in both
    languages (HTML and PDF)."""
    from servegrid.reporting import document, figures, interchange, run_comparison

    source = {
        "generate": {
            "seed": 5,
            "duration_s": 4,
            "rate": 3,
            "input_median": 48,
            "output_median": 3,
            "max_input": 200,
            "max_output": 4,
            "session_share": 0.2,
            "think_mean_s": 0.1,
        }
    }
    experiment = trace_experiment(source, [1, 2], block_tokens=16)
    summary, _ = replay(experiment, sandbox, tmp_path)
    assert list(summary["load"]) == ["x1", "x2"] and summary["valid"].all()
    tables = RunTables.under(tmp_path / "tables")
    rates = pd.read_parquet(tables.rates)
    assert rates.iloc[0]["sustainable_speedup"] == 2  # the calibration server keeps up with both
    words = {"pt": ("Reprodução de trace", r"a 2,00× o trace"), "hu": ("Trace-visszajátszás", r"a trace 2,00×-esén")}
    for lang, (heading, sustained) in words.items():
        figures_dir = tmp_path / "figures" / lang
        drawn = figures.draw_all(experiment, tables, figures_dir, lang)
        assert figures_dir / "trace_shape.png" in drawn
        html, pdf = tmp_path / f"r-{lang}.html", tmp_path / f"r-{lang}.pdf"
        document.render(experiment, lang, tables, figures_dir, str(html), str(pdf))
        page = html.read_text(encoding="utf-8")
        section = page.split('id="trace"')[1].split("</section>")[0]
        assert heading in section and 'id="fig-trace_shape"' in section and 'class="grid primary' not in section
        open_section = page.split('id="open-loop"')[1].split("</section>")[0]
        assert sustained in open_section and "· 1,00×" in open_section  # the cells, named by their speedup
        assert pdf.stat().st_size > 10_000
    # The vllm bench serve export: the real offered rate, no burstiness (the trace's own schedule).
    interchange.write_bench_results(pd.read_parquet(tables.requests), summary, "calibration", tmp_path / "bench")
    exported = json.loads((tmp_path / "bench" / "trace" / "honest" / "ctx0_x2.json").read_text())
    assert exported["request_rate"] == pytest.approx(summary.iloc[1]["offered_rate"]) and exported["burstiness"] is None
    assert exported["arrival_pattern"] == "trace"
    # servegrid compare matches trace cells (a run against itself: nothing moved), named by speedup.
    compared = run_comparison.compare_runs(tmp_path / "tables", tmp_path / "tables")
    assert sorted(compared["cell"]) == ["honest/trace/ctx0_x1", "honest/trace/ctx0_x2"] and not compared["moved"].any()
