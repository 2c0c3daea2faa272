"""vLLM's part of servegrid's preflight: what a vLLM server of one configuration would refuse or silently do,
found before any weights load.

- :func:`static_findings`: from the launch flags and environment alone (no vLLM needed here): the parallel
  layout against the configuration's GPUs, the prefix-cache reset route (dev mode), and the speculative method
  against the checkpoint's config.json (its MTP layers);
- :func:`probe`: the argv through the user's own vLLM (:mod:`servegrid.engines.vllm_probe`, run with the
  interpreter ``engine.command`` starts): its parser, its validation, and its engine configuration.

What the checks read in vLLM 0.32's source: docs/gpu-host.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from servegrid import redact
from servegrid.engines.base import EngineFinding

PROBE = Path(__file__).with_name("vllm_probe.py")
DEV_MODE_VAR = "VLLM_SERVER_DEV_MODE"  # read as bool(int(...)) by vLLM (envs.py): "1", never "true"
# The modules whose parser the probe knows: `python -m MODULE` → the probe's style.
MODULE_STYLES = {
    "vllm.entrypoints.openai.api_server": "api_server",
    "vllm.entrypoints.cli.main": "serve",
}
# Where a checkpoint's config.json keeps its MTP depth (vllm/config/speculative.py, hf_config_override).
MTP_DEPTH_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")
# Its own words, verbatim; it says them whenever more than one draft token runs (vllm/config/speculative.py).
MTP_REUSE_REASON = (
    "Enabling num_speculative_tokens > 1 will run multiple times of forward on same MTP layer,"
    "which may result in lower acceptance rate"
)


def flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value of the last of ``names`` in ``args`` (``--x v``, ``--x=v``), as vLLM's parser reads it."""
    value = None
    for i, arg in enumerate(args):
        if redact.flag_name(arg) in names:
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else None)
    return value


def devices_needed(args: Sequence[str]) -> int:
    """GPUs one server uses: tensor × pipeline × prefill-context × data parallel sizes (vllm/config/parallel.py's
    world size, data parallelism on one node added). Sizes set in a ``--config`` file are not seen here."""
    size = 1
    for names in (
        ("--tensor-parallel-size", "-tp"),
        ("--pipeline-parallel-size", "-pp"),
        ("--prefill-context-parallel-size", "-pcp"),
        ("--data-parallel-size", "-dp"),
    ):
        with contextlib.suppress(TypeError, ValueError):
            size *= max(1, int(flag_value(args, *names) or 1))
    return size


def mtp_depth(checkpoint: Mapping[str, Any]) -> int | None:
    """The checkpoint's MTP layers, from its config.json (a multimodal model keeps them in text_config)."""
    for section in (checkpoint, checkpoint.get("text_config") or {}):
        for key in MTP_DEPTH_KEYS:
            if isinstance(section.get(key), int):
                return int(section[key])
    return None


def static_findings(
    args: Sequence[str],
    env: Mapping[str, str],
    gpus: Sequence[int],
    speculative: Mapping[str, Any] | None,
    checkpoint: Mapping[str, Any] | None,
) -> list[EngineFinding]:
    findings = []
    needed = devices_needed(args)
    if gpus and needed != len(gpus):
        # More than it gets: vLLM stops at start-up. Fewer: the others idle (or a --config file sets the sizes).
        findings.append(
            EngineFinding(
                "error" if needed > len(gpus) else "warning",
                f"the server would use {needed} GPU(s) (tensor × pipeline × context × data parallel size) but the "
                f"configuration names {len(gpus)} ({list(gpus)}): "
                + ("the others would idle" if needed < len(gpus) else "vLLM stops at start-up"),
                "gpus",
            )
        )
    dev_mode = env.get(DEV_MODE_VAR, "0").strip()
    if not dev_mode.lstrip("-").isdigit():
        findings.append(
            EngineFinding(
                "error",
                f'{DEV_MODE_VAR}={dev_mode!r}: vLLM reads it as an integer (bool(int(...))) and stops; write "1"',
                f"env:{DEV_MODE_VAR}",
            )
        )
    elif int(dev_mode) == 0:
        findings.append(
            EngineFinding(
                "warning",
                f"{DEV_MODE_VAR} is not 1: vLLM serves no /reset_prefix_cache, so no cell can empty the prefix "
                "cache before it measures; each measures on fresh content instead (a cell's cache starts with "
                "what earlier cells left, which its own prompts never match)",
                f"env:{DEV_MODE_VAR}",
            )
        )
    method = str((speculative or {}).get("method", ""))
    if "mtp" in method and checkpoint is not None:
        depth = mtp_depth(checkpoint)
        model_type = checkpoint.get("model_type", "?")
        if not depth:
            findings.append(
                EngineFinding(
                    "error",
                    f"speculative method '{method}' needs the checkpoint's MTP layers, and its config.json "
                    f"(model_type {model_type}) has none ({', '.join(MTP_DEPTH_KEYS)}: "
                    f"{'0' if depth == 0 else 'absent'})",
                    "speculative.method",
                )
            )
        else:
            tokens = int((speculative or {}).get("num_speculative_tokens") or 1)
            if tokens % depth:  # vllm/config/speculative.py refuses it when it builds the engine's configuration
                findings.append(
                    EngineFinding(
                        "error",
                        f"{tokens} draft tokens from {depth} MTP layers of {model_type}: vLLM 0.32 refuses a count "
                        f"not divisible by the layers (num_speculative_tokens:{tokens} must be divisible by "
                        f"n_predict={depth})",
                        "speculative.num_speculative_tokens",
                    )
                )
            elif tokens > depth:
                findings.append(
                    EngineFinding(
                        "warning",
                        f"{tokens} draft tokens from {depth} MTP layer(s) of {model_type}: each layer runs "
                        f'{tokens // depth} times; vLLM says "{MTP_REUSE_REASON}"',
                        "speculative.num_speculative_tokens",
                    )
                )
    return findings


def probe_target(argv: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """(interpreter, style, the argv after the program) for a server argv the probe can read, else None.

    ``python -m vllm.entrypoints.openai.api_server ...`` names its interpreter; a ``vllm`` console script names
    it in its first line (``#!/path/to/python``).
    """
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] in MODULE_STYLES:
        style, rest = MODULE_STYLES[argv[2]], list(argv[3:])
        return str(argv[0]), style, rest
    executable = shutil.which(argv[0]) if argv else None
    if executable is None or Path(executable).name != "vllm":
        return None
    with contextlib.suppress(OSError, UnicodeDecodeError, IndexError):
        first = Path(executable).read_text(encoding="utf-8").splitlines()[0]
        if first.startswith("#!") and "python" in first:
            words = first[2:].split()
            if Path(words[0]).name == "env":  # "#!/usr/bin/env python3": the interpreter PATH names
                return shutil.which(words[1]) or words[1], "serve", list(argv[1:])
            return words[0], "serve", list(argv[1:])
    return None


def probe(
    argvs: Mapping[str, Sequence[str]], env: Mapping[str, str], timeout_s: float
) -> dict[str, tuple[list[EngineFinding], dict[str, Any]]]:
    """Each server's full argv (name → argv) through the user's own vLLM (the interpreter the first names), in one
    process started in the servers' ``env`` (their GPUs and variables; never a download) from this folder, as the
    servers are: name → (findings, facts)."""
    targets = {name: probe_target(argv) for name, argv in argvs.items()}
    out: dict[str, tuple[list[EngineFinding], dict[str, Any]]] = {}
    for name, target in targets.items():
        argv = argvs[name]
        if target is None and argv and Path(argv[0]).name == "vllm" and shutil.which(argv[0]) is None:
            found = f"engine.command starts '{argv[0]}', which is not on PATH here: no server could start"
            out[name] = ([EngineFinding("error", found, "command")], {})
        elif target is None:
            note = (
                f"engine.command starts '{argv[0] if argv else ''}', not `vllm serve` nor `python -m "
                f"{' | '.join(MODULE_STYLES)}`: its flags are not checked against vLLM's parser"
            )
            out[name] = ([EngineFinding("note", note, "command")], {})
    known = {name: t for name, t in targets.items() if t is not None}
    if not known:
        return out
    python = next(iter(known.values()))[0]
    # The server starts from this folder: a relative interpreter is relative to it (never resolved through the
    # virtual environment's symlink, which would leave the environment).
    python = os.path.abspath(python) if os.sep in python else (shutil.which(python) or python)

    def every(finding: EngineFinding) -> dict[str, tuple[list[EngineFinding], dict[str, Any]]]:
        return {**out, **{name: ([finding], {}) for name in known}}

    if shutil.which(python) is None:
        return every(EngineFinding("error", f"the engine's interpreter {python} does not exist", "command"))
    with tempfile.TemporaryDirectory(prefix="servegrid-probe-") as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        server_offline = {**os.environ, **env}.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
        requests = {
            name: {"style": style, "argv": rest, "deep": True, "server_offline": server_offline}
            for name, (_, style, rest) in known.items()
        }
        request.write_text(json.dumps(requests), encoding="utf-8")
        probe_env = {**os.environ, **env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        try:
            # As -c: run as a file, its own folder (which holds servegrid's vllm.py) would come first on sys.path
            # and shadow vLLM.
            done = subprocess.run(
                [python, "-c", PROBE.read_text(encoding="utf-8"), str(request), str(result)],
                env=probe_env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return every(EngineFinding("warning", f"the probe in {python} took over {timeout_s:.0f} s: unchecked"))
        if not result.exists():
            tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            message = f"the probe could not run in {python} (exit {done.returncode}): {tail[-400:]}; flags unchecked"
            return every(EngineFinding("warning", message))
        answers = json.loads(result.read_text(encoding="utf-8"))
    for name, answer in answers.items():
        findings = [
            EngineFinding(f["level"], f["message"], f"args:{f['flag']}" if f.get("flag") else None)
            for f in answer["findings"]
        ]
        out[name] = (findings, {**answer["facts"], "checked": answer["checked"]})
    return out
