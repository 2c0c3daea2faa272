"""servegrid preflight without running an engine (probe=False): what the flags, the checkpoint's config.json, the
Hugging Face Hub and the host's environment say, each finding naming the key to change. The checks through the real
vLLM's own parser are in tests/integration/test_preflight.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from huggingface_hub import constants

from helpers import REPO, with_changes
from servegrid.config import Experiment
from servegrid.errors import PreflightError
from servegrid.pipeline import cli
from servegrid.planning import preflight

NO_PROXIES: dict[str, str] = {}


def findings(report: preflight.Report, level: str) -> list[tuple[str | None, str]]:
    return [(f.configuration, f.key) for f in report.findings if f.level == level]


def checkpoint(folder: Path, chat_template: bool = True, **config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], **config}))
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    if chat_template:  # as Qwen's checkpoints carry one
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return folder


def test_tensor_parallel_size_against_the_gpus_a_configuration_names(seed_raw, tmp_path):
    mtp3 = checkpoint(tmp_path / "m", model_type="qwen3_next", num_nextn_predict_layers=3)
    raw = with_changes(seed_raw, **{"model.path": str(mtp3)})
    raw["configurations"]["prefix_cache"]["args"] = ["--tensor-parallel-size", "2"]  # TP 2 on gpus [0]
    raw["configurations"]["mtp"]["gpus"] = [0, 1]  # engine.args says TP 1: one of the two would idle
    report = preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES)
    errors = {(f.configuration, f.key): f.message for f in report.errors}
    warnings = {(f.configuration, f.key): f.message for f in report.findings if f.level == "warning"}
    assert "would use 2 GPU(s)" in errors[("prefix_cache", "configurations.prefix_cache.gpus")]  # vLLM would stop
    assert "the others would idle" in warnings[("mtp", "configurations.mtp.gpus")]  # or a --config file sets TP
    assert ("mtp_prefix_cache", "configurations.mtp_prefix_cache.gpus") not in {**errors, **warnings}  # TP 1, 1 GPU
    assert len(report.errors) == 1
    with pytest.raises(PreflightError, match=r"^preflight: prefix_cache: configurations\.prefix_cache\.gpus: "):
        report.raise_for_errors()


def test_an_mtp_method_on_a_checkpoint_without_mtp_layers(seed_raw, tmp_path):
    dense = checkpoint(tmp_path / "dense", model_type="qwen3")  # no num_nextn_predict_layers
    report = preflight.run(
        Experiment(with_changes(seed_raw, **{"model.path": str(dense)})), probe=False, environ=NO_PROXIES
    )
    assert set(findings(report, "error")) == {
        ("mtp", "configurations.mtp.speculative.method"),
        ("mtp_prefix_cache", "configurations.mtp_prefix_cache.speculative.method"),
    }
    assert "has none" in report.errors[0].message and "qwen3" in report.errors[0].message
    # One MTP layer and 3 draft tokens: it runs, reusing the layer; a warning in vLLM's own words.
    one_layer = checkpoint(tmp_path / "mtp1", model_type="qwen3_next", num_nextn_predict_layers=1)
    report = preflight.run(
        Experiment(with_changes(seed_raw, **{"model.path": str(one_layer)})), probe=False, environ=NO_PROXIES
    )
    assert report.errors == []
    warned = [f for f in report.findings if f.key == "configurations.mtp.speculative.num_speculative_tokens"]
    assert len(warned) == 1 and "lower acceptance rate" in warned[0].message
    assert "the checkpoint's config.json" in report.checked["mtp"]


def test_a_proxy_variable_without_no_proxy_for_the_servers_host(seed_raw, tmp_path):
    experiment = Experiment(
        with_changes(
            seed_raw,
            **{"model.path": str(checkpoint(tmp_path / "m", model_type="qwen3_next", num_nextn_predict_layers=3))},
        )
    )
    proxied = preflight.run(experiment, probe=False, environ={"https_proxy": "http://proxy.example:3128"})
    assert findings(proxied, "error") == [(None, "environment: no_proxy")]
    assert "https_proxy" in proxied.errors[0].message and "no_proxy=127.0.0.1" in proxied.errors[0].message
    exempt = {"http_proxy": "http://proxy.example:3128", "no_proxy": "localhost,127.0.0.1"}
    assert preflight.run(experiment, probe=False, environ=exempt).errors == []


def test_without_dev_mode_every_configuration_is_told_it_cannot_reset_the_cache(seed_raw, tmp_path):
    raw = with_changes(
        seed_raw, **{"model.path": str(checkpoint(tmp_path / "m", model_type="qwen3_next", num_nextn_predict_layers=3))}
    )
    found = preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES).findings
    assert not [f for f in found if "DEV_MODE" in f.key]  # config.yaml sets it
    raw["engine"]["env"] = {}
    report = preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES)
    warned = [(f.configuration, f.key) for f in report.findings if f.level == "warning"]
    assert warned == [(n, "engine.env.VLLM_SERVER_DEV_MODE") for n in ("prefix_cache", "mtp", "mtp_prefix_cache")]
    assert "fresh content" in report.findings[0].message


class FakeHub(BaseHTTPRequestHandler):
    """The Hub's model-info route, answering a checkpoint of one petabyte (a loopback server in the Hub's dialect:
    huggingface_hub's own client reads it)."""

    # What the Hub answers for a gated repo the token cannot read, and for one that does not exist (or is private).
    REFUSING: ClassVar[dict[str, tuple[int, str]]] = {
        "/api/models/org/gated": (403, "GatedRepo"),
        "/api/models/org/missing": (401, "RepoNotFound"),
    }

    def do_GET(self) -> None:  # http.server's name for it
        if not self.path.startswith("/api/models/"):
            self.send_error(404)
            return
        refused = next((v for k, v in self.REFUSING.items() if self.path.startswith(k)), None)
        if refused:
            self.send_response(refused[0])
            self.send_header("X-Error-Code", refused[1])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps(
            {
                "id": "org/huge",
                "sha": "0" * 40,
                "siblings": [
                    {"rfilename": "config.json", "size": 700},
                    {"rfilename": "model-00001-of-00002.safetensors", "size": 5 * 10**14},
                    {"rfilename": "model-00002-of-00002.safetensors", "size": 5 * 10**14},
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:  # the file routes: this Hub has no config.json to give
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_hub(monkeypatch, tmp_path) -> Iterator[str]:
    hub = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=hub.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{hub.server_address[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", url)  # the API routes; the file routes' template was built at import
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    yield url
    hub.shutdown()


def test_a_missing_model_whose_download_would_not_fit_on_the_disk(seed_raw, fake_hub, tmp_path):
    report = preflight.run(
        Experiment(with_changes(seed_raw, **{"model.path": "org/huge"})), probe=False, environ=NO_PROXIES
    )
    assert findings(report, "error") == [(None, "model.path")]
    message = report.errors[0].message
    assert "org/huge is not on this machine" in message and "931322.6 GiB" in message  # 10^15 bytes
    assert str(tmp_path / "hf-cache") in message


@pytest.mark.parametrize(
    ("repo", "says"),
    [
        ("org/gated", "org/gated is gated on the Hugging Face Hub and this machine's token has no access"),
        ("org/missing", "org/missing is not on the Hugging Face Hub, or it is private"),
    ],
)
def test_a_checkpoint_the_hub_will_not_give_is_an_error_naming_hf_token(seed_raw, fake_hub, monkeypatch, repo, says):
    """Issue 42: a gated, missing or unauthorised repo was a warning; the servers then failed at start-up, after the
    weights of the other configurations had loaded."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    report = preflight.run(Experiment(with_changes(seed_raw, **{"model.path": repo})), probe=False, environ=NO_PROXIES)
    assert findings(report, "error") == [(None, "model.path")]
    assert says in report.errors[0].message and "HF_TOKEN is not set" in report.errors[0].message
    assert "export HF_TOKEN" in report.errors[0].message


def test_on_this_host_it_says_what_it_could_not_check(seed_raw, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the seed's checkpoint is not here; the Hub is not asked
    report = preflight.run(Experiment(seed_raw), probe=False, environ=NO_PROXIES)
    text = report.text()
    assert any(u.startswith("GPUs: no nvidia-smi") for u in report.unchecked), text
    assert any("config.json" in u for u in report.unchecked), text
    assert [(f.level, f.key) for f in report.findings] == [("warning", "model.path")]
    assert "HF_HUB_OFFLINE" in report.findings[0].message


def test_the_cli_exits_non_zero_on_an_error_and_writes_its_findings(seed_raw, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = with_changes(seed_raw, **{"model.path": str(checkpoint(tmp_path / "dense", model_type="qwen3"))})
    (tmp_path / "c.yaml").write_text(json.dumps(raw))
    argv = ["preflight", "--no-engine", "--config", str(tmp_path / "c.yaml"), "--json", str(tmp_path / "f.json")]
    code = cli.main(argv)
    out = capsys.readouterr().out
    assert code == 1
    assert "ERROR     mtp: configurations.mtp.speculative.method:" in out
    written = json.loads((tmp_path / "f.json").read_text())
    assert {f["configuration"] for f in written["findings"] if f["level"] == "error"} == {"mtp", "mtp_prefix_cache"}
    assert cli.main(["preflight", "--no-engine", "--config", str(REPO / "config" / "cpu-demo.yaml")]) == 0


def test_a_draft_count_the_mtp_layers_do_not_divide_and_a_dev_mode_vllm_cannot_read(seed_raw, tmp_path):
    two_layers = checkpoint(tmp_path / "mtp2", model_type="qwen3_next", num_nextn_predict_layers=2)
    raw = with_changes(seed_raw, **{"model.path": str(two_layers), "engine.env": {"VLLM_SERVER_DEV_MODE": "true"}})
    report = preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES)
    errors = {(f.configuration, f.key): f.message for f in report.errors}
    assert (
        "must be divisible by n_predict=2" in errors[("mtp", "configurations.mtp.speculative.num_speculative_tokens")]
    )
    assert "bool(int(...))" in errors[("prefix_cache", "engine.env.VLLM_SERVER_DEV_MODE")]


def test_nvidia_smi_rows_with_a_comma_in_the_name_or_no_memory_figure(monkeypatch):
    from servegrid.planning import host_checks

    out = "0, NVIDIA H100 80GB HBM3, GPU-aaa, 81000, 81559\n1, Vendor, Model X, GPU-bbb, [N/A], [N/A]\n"
    monkeypatch.setattr(host_checks.hostinfo, "nvidia_smi", lambda *args: out)
    memory = host_checks.gpu_memory()
    assert memory is not None and list(memory) == [0]  # GPU 1 says no figure: left out, not a crash
    assert memory[0].uuid == "GPU-aaa" and memory[0].free_bytes == 81000 * 2**20


def test_a_vllm_console_script_started_through_env_names_its_interpreter(tmp_path, monkeypatch):
    from servegrid.engines import vllm_preflight

    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text("#!/usr/bin/env python3\nimport sys\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")
    python, style, rest = vllm_preflight.probe_target(["vllm", "serve", "/m", "--port", "1"])
    assert Path(python).name.startswith("python3") and style == "serve" and rest == ["serve", "/m", "--port", "1"]


def test_a_vllm_other_than_the_one_servegrid_was_checked_against_is_named(monkeypatch):
    """Issue 42: the GPU path (flags, metric names, cache modes, the engine's death in its log) was read against
    vLLM 0.32's source; another version is said before the first GPU hour."""
    from servegrid.engines import vllm as vllm_engine
    from servegrid.engines import vllm_preflight
    from servegrid.engines.base import ServerLaunch

    launch = ServerLaunch(argv=["vllm", "serve", "/m"], env={}, gpus=[0], speculative=None)
    for version, warned in (("0.32.0", False), ("0.33.1", True)):
        monkeypatch.setattr(vllm_preflight, "probe", lambda *a, v=version: {"mtp": ([], {"vllm_version": v})})
        found, facts = vllm_engine.VLLMEngine().preflight({"mtp": launch}, None, 10.0)["mtp"]
        said = [f.message for f in found if f.level == "warning" and "servegrid was checked against" in f.message]
        assert bool(said) is warned and facts["vllm_version"] == version
    assert said[0].startswith("vLLM 0.33.1 runs the servers; servegrid was checked against vLLM 0.32.0")


def test_a_chat_workload_on_a_checkpoint_without_a_chat_template(seed_raw, tmp_path):
    """Issue 42: multi_turn sends through the chat endpoint; without a template vLLM answers each request with HTTP
    400 (transformers has no default since 4.44), found only after the weights had loaded."""
    bare = checkpoint(tmp_path / "bare", chat_template=False, model_type="qwen3")
    raw = with_changes(seed_raw, **{"model.path": str(bare)})
    report = preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES)
    (said,) = [f.message for f in report.errors if f.key == "model.path"]
    assert "has no chat template" in said and "workloads.multi_turn sends through the chat endpoint" in said
    given = with_changes(raw, **{"engine.args": [*raw["engine"]["args"], "--chat-template", "/t.jinja"]})
    assert not [
        f for f in preflight.run(Experiment(given), probe=False, environ=NO_PROXIES).errors if f.key == "model.path"
    ]
    (bare / "chat_template.jinja").write_text("{{ messages }}")
    assert not [
        f for f in preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES).errors if f.key == "model.path"
    ]
    raw["workloads"].pop("multi_turn")
    (bare / "chat_template.jinja").unlink()
    assert not [
        f for f in preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES).errors if f.key == "model.path"
    ]


# A dense 32B in the shape of Qwen3-32B's config.json: 64 layers, 8 KV heads of 128, bfloat16.
DENSE_32B = {
    "model_type": "qwen3",
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 5120,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960,
}
H100 = "0, NVIDIA H100 80GB HBM3, GPU-aaa, 81000, 81559\n1, NVIDIA H100 80GB HBM3, GPU-bbb, 81000, 81559\n"


@pytest.mark.parametrize(
    ("weights_gib", "level"),
    [
        (33, None),  # the pool left (40 GiB) holds one 262,144-token request (32 GiB of FP8 KV) with room to spare
        (39, "warning"),  # 34.3 GiB left: fits before activations, not by the 5% they may take
        (45, "error"),  # 28.3 GiB left: vLLM refuses to start ("To serve at least one request ...")
    ],
)
def test_a_kv_pool_that_cannot_hold_one_full_length_request(seed_raw, tmp_path, monkeypatch, weights_gib, level):
    from servegrid.planning import host_checks

    monkeypatch.setattr(host_checks.hostinfo, "nvidia_smi", lambda *args: H100)
    folder = checkpoint(tmp_path / "dense", **DENSE_32B)
    with (folder / "model.safetensors").open("wb") as weights:
        weights.truncate(weights_gib * 2**30)  # sparse: its size is all the check reads
    # config.yaml's engine.args: --max-model-len 262144 --kv-cache-dtype fp8, TP 1: 2 × 64 × 8 × 128 × 1 B a token.
    raw = with_changes(seed_raw, **{"model.path": str(folder)})
    report = preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES)
    said = [f for f in report.findings if f.key == "engine.args (--max-model-len)"]
    if level is None:
        assert said == [], said
        return
    assert {f.level for f in said} == {level} and len(said) == len(raw["configurations"]), said
    assert "one request of 262,144 tokens (--max-model-len) needs 32.0 GiB of KV cache there (131,072 B a token)" in (
        said[0].message
    )


def test_kv_per_token_follows_the_layout_and_the_cache_dtype():
    from servegrid.engines.vllm_kv import kv_demand

    base = ["--max-model-len", "32k"]
    assert kv_demand(base, DENSE_32B).bytes_per_token == 2 * 64 * 8 * 128 * 2  # bfloat16, as the model
    assert kv_demand(base, DENSE_32B).max_model_len == 32_000  # vLLM's "k" is decimal, its "K" binary
    assert kv_demand(["--max-model-len", "32K"], DENSE_32B).max_model_len == 32_768
    assert kv_demand(["--max-model-len", "-1"], DENSE_32B).max_model_len == 40960  # "auto": the checkpoint's
    assert kv_demand([*base, "--kv-cache-dtype", "fp8"], DENSE_32B).bytes_per_token == 2 * 64 * 8 * 128
    assert kv_demand([*base, "-tp", "4"], DENSE_32B).bytes_per_token == 2 * 64 * 2 * 128 * 2  # 8 heads / 4 ranks
    assert kv_demand([*base, "-tp", "16"], DENSE_32B).bytes_per_token == 2 * 64 * 1 * 128 * 2  # at least one head
    assert kv_demand([*base, "-pp", "3"], DENSE_32B).bytes_per_token == 2 * 22 * 8 * 128 * 2  # the largest stage
    assert kv_demand([], DENSE_32B).max_model_len == 40960  # the checkpoint's own length
    # Caches sized otherwise: unchecked.
    assert kv_demand(base, {**DENSE_32B, "layer_types": ["linear_attention", "full_attention"]}) is None
    assert kv_demand(base, {**DENSE_32B, "sliding_window": 4096}) is None
    assert kv_demand(base, {**DENSE_32B, "kv_lora_rank": 512}) is None
    assert kv_demand([*base, "--kv-cache-dtype", "nvfp4"], DENSE_32B) is None
    assert kv_demand(base, None) is None


def test_configurations_on_different_gpu_models_are_told_so(seed_raw, monkeypatch):
    from servegrid.planning import host_checks

    mixed = "0, NVIDIA H100 80GB HBM3, GPU-aaa, 81000, 81559\n1, NVIDIA H100 PCIe, GPU-bbb, 81000, 81559\n"
    for listing, warned in ((H100, False), (mixed, True)):
        monkeypatch.setattr(host_checks.hostinfo, "nvidia_smi", lambda *args, listing=listing: listing)
        report = preflight.run(Experiment(seed_raw), probe=False, environ=NO_PROXIES)
        said = [f for f in report.findings if f.key == "configurations.*.gpus"]
        assert bool(said) is warned, said
    assert said[0].level == "warning"
    assert (
        "mtp on GPU(s) [1]: NVIDIA H100 PCIe" in said[0].message
    )  # config.yaml: prefix_cache and mtp_prefix_cache on 0


def test_a_port_range_among_the_kernels_ephemeral_ports_is_warned_of(seed_raw, tmp_path, monkeypatch):
    from servegrid.planning import host_checks

    ports = tmp_path / "ip_local_port_range"
    ports.write_text("32768\t60999\n")
    monkeypatch.setattr(host_checks, "EPHEMERAL_PORTS", str(ports))
    for port_range, warned in (([8100, 8199], False), ([32700, 32800], True), ([57077, 57097], True)):
        raw = with_changes(seed_raw, **{"operations.port_range": port_range})
        report = preflight.run(Experiment(raw), probe=False, environ=NO_PROXIES)
        said = [f for f in report.findings if f.key == "operations.port_range"]
        assert bool(said) is warned, (port_range, said)
    assert said[0].level == "warning" and "overlaps the kernel's ephemeral ports 32768-60999" in said[0].message
