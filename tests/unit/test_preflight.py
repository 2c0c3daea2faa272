"""servegrid preflight without running an engine (probe=False): what the flags, the checkpoint's config.json, the
Hugging Face Hub and the host's environment say, each finding naming the key to change. The checks through the real
vLLM's own parser are in tests/integration/test_preflight.py."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

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


def checkpoint(folder: Path, **config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], **config}))
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
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
    report = preflight.run(Experiment(with_changes(seed_raw, **{"model.path": str(dense)})), probe=False,
                           environ=NO_PROXIES)  # fmt: skip
    assert set(findings(report, "error")) == {
        ("mtp", "configurations.mtp.speculative.method"),
        ("mtp_prefix_cache", "configurations.mtp_prefix_cache.speculative.method"),
    }
    assert "has none" in report.errors[0].message and "qwen3" in report.errors[0].message
    # One MTP layer and 3 draft tokens: it runs, reusing the layer; a warning in vLLM's own words.
    one_layer = checkpoint(tmp_path / "mtp1", model_type="qwen3_next", num_nextn_predict_layers=1)
    report = preflight.run(Experiment(with_changes(seed_raw, **{"model.path": str(one_layer)})), probe=False,
                           environ=NO_PROXIES)  # fmt: skip
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
    raw = with_changes(seed_raw, **{"model.path": str(checkpoint(tmp_path / "m", model_type="qwen3_next",
                                                                 num_nextn_predict_layers=3))})  # fmt: skip
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

    def do_GET(self) -> None:  # http.server's name for it
        if not self.path.startswith("/api/models/"):
            self.send_error(404)
            return
        body = json.dumps({"id": "org/huge", "sha": "0" * 40, "siblings": [
            {"rfilename": "config.json", "size": 700},
            {"rfilename": "model-00001-of-00002.safetensors", "size": 5 * 10**14},
            {"rfilename": "model-00002-of-00002.safetensors", "size": 5 * 10**14},
        ]}).encode()  # fmt: skip
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
    report = preflight.run(Experiment(with_changes(seed_raw, **{"model.path": "org/huge"})), probe=False,
                           environ=NO_PROXIES)  # fmt: skip
    assert findings(report, "error") == [(None, "model.path")]
    message = report.errors[0].message
    assert "org/huge is not on this machine" in message and "931322.6 GiB" in message  # 10^15 bytes
    assert str(tmp_path / "hf-cache") in message


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
