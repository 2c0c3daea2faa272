"""Config validation, the grid, and the slices that decide reruns."""

from __future__ import annotations

import re

import pytest

from helpers import with_changes
from servegrid.config import Experiment
from servegrid.errors import ConfigError


def test_both_shipped_configs_are_valid(seed_raw, demo_raw):
    seed, demo = Experiment(seed_raw), Experiment(demo_raw)
    assert list(seed.configurations) == ["prefix_cache", "mtp", "mtp_prefix_cache"]
    assert seed.configurations["mtp"].speculative == {"method": "mtp", "num_speculative_tokens": 3}
    assert seed.configurations["prefix_cache"].prefix_caching is True
    assert seed.configurations["mtp"].prefix_caching is False
    assert "--kv-cache-dtype" in seed.engine.args and "262144" in seed.engine.args
    assert seed.engine.kind == "vllm"
    assert seed.modes() == demo.modes() == ["decode", "single_turn", "multi_turn"]
    assert demo.configurations["ngram"].speculative["method"] == "ngram"
    assert demo.temperature == 0
    # 6 decode + 2x5 single-turn + 5x5 multi-turn, per configuration (the seed's two, and both together)
    assert len(seed.cells()) == 3 * (6 + 10 + 25)
    assert seed.configurations["mtp_prefix_cache"].prefix_caching is True
    assert seed.engine.env == {"VLLM_SERVER_DEV_MODE": "1"}


def test_defaults_are_filled(demo_raw):
    raw = with_changes(demo_raw)
    del raw["operations"]
    del raw["workloads"]["decode"]["output_tokens"]
    experiment = Experiment(raw)
    assert experiment.operations.host == "127.0.0.1"
    assert experiment.workload("decode").settings["output_tokens"] == 512
    assert experiment.configurations["prefix_cache"].gpus == ()


@pytest.mark.parametrize(
    ("dotted", "value", "named"),
    [
        ("workloads.decode.concurrency", [1, 0], "workloads.decode.concurrency[1]"),
        ("workloads.decode.output_tokens", "many", "workloads.decode.output_tokens"),
        ("operations.port_range", [8000], "operations.port_range"),
        ("sampling.temperature", -1, "sampling.temperature"),
        ("configurations.prefix_cache.prefix_caching", "yes", "configurations.prefix_cache.prefix_caching"),
    ],
)
def test_invalid_values_name_the_key(demo_raw, dotted, value, named):
    with pytest.raises(ConfigError) as error:
        Experiment(with_changes(demo_raw, **{dotted: value}), source="demo.yaml")
    assert f"demo.yaml: {named}:" in str(error.value)


def test_unknown_keys_are_rejected_by_name(demo_raw):
    raw = with_changes(demo_raw)
    raw["workloads"]["decode"]["prompt_tokens"] = 1024
    with pytest.raises(ConfigError, match=r"workloads\.decode: .*'prompt_tokens' was unexpected"):
        Experiment(raw)


def test_bad_configuration_name_is_rejected(demo_raw):
    raw = with_changes(demo_raw)
    raw["configurations"]["Bad Name"] = raw["configurations"]["ngram"]
    with pytest.raises(ConfigError, match="configurations"):
        Experiment(raw)


@pytest.mark.parametrize(
    "flag", ["--enable-prefix-caching", "--port", "--speculative-config={}", "--host", "--enable_prefix_caching"]
)
def test_flags_servegrid_owns_are_refused(demo_raw, flag):
    with pytest.raises(ConfigError, match=r"configurations\.ngram\.args: '--"):
        Experiment(with_changes(demo_raw, **{"configurations.ngram.args": [flag]}))


def test_semantic_checks_name_the_key(demo_raw):
    with pytest.raises(ConfigError, match=r"engine\.command: needs a '\{model\}'"):
        Experiment(with_changes(demo_raw, **{"engine.command": ["vllm", "serve"]}))
    with pytest.raises(ConfigError, match=r"engine\.args: .*--load-format dummy"):
        Experiment(with_changes(demo_raw, **{"engine.args": []}))
    with pytest.raises(ConfigError, match=r"configurations\.ngram\.env: set GPUs with 'gpus'"):
        Experiment(with_changes(demo_raw, **{"configurations.ngram.env": {"CUDA_VISIBLE_DEVICES": "0"}}))
    with pytest.raises(ConfigError, match="no workload mode is enabled"):
        raw = with_changes(demo_raw)
        for mode in raw["workloads"].values():
            mode["enabled"] = False
        Experiment(raw)


def test_launch_flags_come_from_the_configuration(seed_raw):
    seed = Experiment(seed_raw)
    assert seed.configuration_flags("prefix_cache") == ["--enable-prefix-caching"]
    assert seed.configuration_flags("mtp") == [
        "--no-enable-prefix-caching",
        "--speculative-config",
        '{"method":"mtp","num_speculative_tokens":3}',
    ]


def test_cell_settings_are_the_cells_own_slice(demo_raw):
    base = Experiment(demo_raw)
    cell = base.cells("ngram")[0]
    assert cell.mode == "decode"
    settings = base.cell_settings(cell)
    # Other modes, other grid values, operations, GPU placement: not part of it.
    unrelated = [
        {"workloads.single_turn.suffix_tokens": 99},
        {"workloads.decode.concurrency": [1, 4, 8]},
        {"operations.request_timeout_s": 5},
        {"operations.port_range": [9000, 9100]},
        {"configurations.ngram.gpus": [3]},
        {"report.languages": ["hu"]},
        {"workloads.multi_turn.sampling": {"max_duration_s": 60}},  # another mode's own rule
    ]
    for change in unrelated:
        other = Experiment(with_changes(demo_raw, **change))
        assert other.cell_settings(cell) == settings, change
        assert other.launch_spec("ngram") == base.launch_spec("ngram"), change
    # Its own mode's settings, sampling and content are.
    for change in [
        {"workloads.decode.output_tokens": 32},
        {"sampling.temperature": 0.5},
        {"workloads.decode.seed": 7},
        {"sampling.target_rel_ci": 0.1},  # its sampling rule: the top-level one...
        {"sampling.min_samples": 12},
        {"workloads.decode.sampling": {"max_duration_s": 60}},  # ...or its mode's own
    ]:
        assert Experiment(with_changes(demo_raw, **change)).cell_settings(cell) != settings, change


def test_launch_spec_changes_only_for_its_configuration(demo_raw):
    base = Experiment(demo_raw)
    changed = Experiment(with_changes(demo_raw, **{"configurations.ngram.args": ["--max-num-seqs", "8"]}))
    assert changed.launch_spec("ngram") != base.launch_spec("ngram")
    assert changed.launch_spec("prefix_cache") == base.launch_spec("prefix_cache")


def test_tiny_model_spec_spells_out_defaults(demo_raw):
    explicit = with_changes(demo_raw, **{"model.tiny": {"vocab_size": 2048}})
    assert Experiment(demo_raw).launch_spec("ngram") == Experiment(explicit).launch_spec("ngram")


def test_cells_outside_the_grid_are_refused(demo_raw):
    experiment = Experiment(demo_raw)
    with pytest.raises(ConfigError, match="not in the grid"):
        experiment.cell("ngram", "decode", 512, 3)


def test_from_file_reports_unreadable_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        Experiment.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        Experiment.from_file(bad)


def test_report_languages_are_the_catalogues(demo_raw):
    with pytest.raises(ConfigError, match=r"report\.languages: no catalogue for de"):
        Experiment(with_changes(demo_raw, **{"report.languages": ["pt", "de"]}))
    assert Experiment(with_changes(demo_raw, **{"report.languages": ["hu"]})).languages == ["hu"]


def test_unknown_engine_and_unknown_mode_fail_by_name(demo_raw):
    with pytest.raises(ConfigError, match=r"engine\.kind: unknown engine 'sglang' \(known: .*vllm"):
        Experiment(with_changes(demo_raw, **{"engine.kind": "sglang"}))
    raw = with_changes(demo_raw)
    raw["workloads"]["decode_short"] = {"contexts": [64], "concurrency": [1]}
    with pytest.raises(ConfigError, match=r"workloads: .*'decode_short' was unexpected"):
        Experiment(raw)
    with pytest.raises(ConfigError, match=r"verdict\.classes\[0\]\.mode"):
        Experiment(with_changes(demo_raw, **{"verdict.classes": [{"id": "x", "mode": "decode_short"}]}))


def test_unknown_mode_is_an_error_everywhere_it_is_looked_up():
    from servegrid import modes
    from servegrid.errors import UnknownModeError

    with pytest.raises(UnknownModeError, match="unknown workload mode 'decode_short'"):
        modes.get("decode_short")


def test_a_key_given_twice_fails_naming_its_line(tmp_path, repo):
    text = (repo / "config" / "cpu-demo.yaml").read_text()
    duplicated = text.replace(
        "configurations:\n", "configurations:\n  ngram:\n    label: first\n    prefix_caching: true\n", 1
    )
    (tmp_path / "dup.yaml").write_text(duplicated)
    line = duplicated.splitlines().index("  ngram:") + 1
    with pytest.raises(ConfigError, match=rf"dup\.yaml:\d+: duplicate key 'ngram' \(first at line {line}\)"):
        Experiment.from_file(tmp_path / "dup.yaml")


@pytest.mark.parametrize(
    ("dotted", "value"),
    [
        ("workloads.decode.concurrency", [1, 2.0]),
        ("workloads.decode.contexts", [512.0]),
        ("workloads.decode.seed", 1.0),
    ],
)
def test_integers_are_integers_as_written(demo_raw, dotted, value):
    with pytest.raises(ConfigError, match=re.escape(dotted) + r".*is not of type 'integer'"):
        Experiment(with_changes(demo_raw, **{dotted: value}))


@pytest.mark.parametrize("flag", [["--max-model-len", "2048"], ["--max_model_len=2048"]])
def test_a_cell_that_cannot_fit_the_context_limit_is_refused_before_any_server_starts(demo_raw, flag):
    args = [a for a in demo_raw["engine"]["args"] if a not in ("--max-model-len", "8192")]
    raw = with_changes(demo_raw, **{"engine.args": args, "configurations.ngram.args": flag})
    # multi_turn at a 2048-token base context (+ two turns + output) cannot fit 2048: named with its key and
    # configuration
    with pytest.raises(ConfigError, match=r"workloads\.multi_turn\.contexts: at context 2048 .* configuration 'ngram'"):
        Experiment(raw)
    raw["workloads"]["single_turn"]["contexts"] = [1024]
    raw["workloads"]["multi_turn"]["contexts"] = [1024]  # 1024 + 2 × 256 + 32 fits
    Experiment(raw)
    raw["workloads"]["multi_turn"]["turns"] = 5  # 1024 + 4 × 256 + 32 does not
    with pytest.raises(
        ConfigError, match=r"workloads\.multi_turn\.contexts: at context 1024 a request holds about 2080"
    ):
        Experiment(raw)


def test_yaml_merge_keys_are_not_duplicates(tmp_path, repo):
    text = (repo / "config" / "cpu-demo.yaml").read_text()
    text = text.replace("configurations:\n  prefix_cache:\n", "configurations:\n  prefix_cache: &base\n", 1)
    text = text.replace("  ngram:\n", "  ngram:\n    <<: *base\n", 1)
    (tmp_path / "merge.yaml").write_text(text)
    assert Experiment.from_file(tmp_path / "merge.yaml").configurations["ngram"].speculative["method"] == "ngram"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-host.example"])
def test_development_routes_are_never_opened_beyond_loopback(seed_raw, host):
    """Issue 42: with VLLM_SERVER_DEV_MODE=1 (the cache reset needs it), vLLM's /collective_rpc, /sleep and
    /reset_prefix_cache answered without the API key, which guards /v1 only."""
    assert seed_raw["engine"]["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    with pytest.raises(
        ConfigError,
        match=rf"operations.host: '{re.escape(host)}' is not a loopback address and "
        r"engine.env sets VLLM_SERVER_DEV_MODE=1",
    ):
        Experiment(with_changes(seed_raw, **{"operations.host": host}))
    for loopback in ("127.0.0.1", "::1", "localhost"):
        Experiment(with_changes(seed_raw, **{"operations.host": loopback}))
    without = with_changes(seed_raw, **{"operations.host": host})
    del without["engine"]["env"]["VLLM_SERVER_DEV_MODE"]
    Experiment(without)  # the cells then measure on fresh content: the preflight warns
