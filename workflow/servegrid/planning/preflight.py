"""``servegrid preflight``: what the host and the user's own engine would refuse, or silently do, for each
configuration, found in seconds before the first server loads its weights. Each finding names the key to change.

Checks, per configuration: the exact argv through the engine's own parser, validation and configuration (vLLM:
:mod:`servegrid.engines.vllm_preflight`), the GPUs it names (the parallel layout, free memory against the weights),
the checkpoint (present here, or its download against the free disk; its MTP layers against the speculative
method), and, once for the run, the proxy variables and the cache-reset route. What could not be checked here is
said as plainly (``unchecked``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from servegrid import engines, modes, redact
from servegrid.config import Experiment
from servegrid.errors import PreflightError, ServerError
from servegrid.planning import checkpoint, host_checks
from servegrid.serving import server, state

LEVELS = ("error", "warning", "note")
PROBE_TIMEOUT_S = 300.0  # importing vLLM takes 10-50 s on a busy CPU host; building its config a few more


@dataclass(frozen=True)
class Finding:
    level: str  # error | warning | note
    configuration: str | None  # None: the whole run
    key: str  # what to change: a config key, or "environment: VARIABLE"
    message: str


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    checked: dict[str, list[str]] = field(default_factory=dict)  # configuration → what was checked
    unchecked: list[str] = field(default_factory=list)
    facts: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def as_json(self) -> dict[str, Any]:
        return {
            "findings": [asdict(f) for f in self.findings],
            "checked": self.checked,
            "unchecked": self.unchecked,
            "facts": self.facts,
        }

    def text(self) -> str:
        lines = []
        for name, checked in self.checked.items():
            lines.append(f"{name}: checked {'; '.join(checked) or 'nothing'}")
        for finding in sorted(self.findings, key=lambda f: LEVELS.index(f.level)):
            where = f"{finding.configuration}: " if finding.configuration else ""
            lines.append(f"{finding.level.upper():10}{where}{finding.key}: {finding.message}")
        lines += [f"{'UNCHECKED':10}{u}" for u in self.unchecked]
        errors = len(self.errors)
        lines.append(f"preflight: {errors} error(s), {sum(f.level == 'warning' for f in self.findings)} warning(s)")
        return "\n".join(lines)

    def raise_for_errors(self) -> None:
        if self.errors:
            first = self.errors[0]
            more = f" (and {len(self.errors) - 1} more; servegrid preflight lists them)" if len(self.errors) > 1 else ""
            where = f"{first.configuration}: " if first.configuration else ""
            raise PreflightError(f"preflight: {where}{first.key}: {first.message}{more}")


def key_of(experiment: Experiment, name: str, where: str | None) -> str:
    """The config key an engine finding's ``where`` points at."""
    conf = experiment.configuration(name)
    prefix = f"configurations.{name}"
    if where is None:
        return prefix
    kind, _, detail = where.partition(":")
    if where in ("gpus", "command"):
        return f"{prefix}.gpus" if where == "gpus" else "engine.command"
    if where.startswith("speculative"):
        return f"{prefix}.{where}"
    if kind == "env":
        return f"{prefix}.env.{detail}" if detail in (conf.env or {}) else f"engine.env.{detail}"
    if kind == "args":
        flag = redact.flag_name(detail)
        if any(redact.flag_name(a) == flag for a in conf.args):
            return f"{prefix}.args ({detail})"
        if any(redact.flag_name(a) == flag for a in experiment.engine.args):
            return f"engine.args ({detail})"
        feature = experiment.configuration_flags(name)
        if any(redact.flag_name(a) == flag for a in feature):
            return f"{prefix}.{'speculative' if 'speculative' in flag else 'prefix_caching'} ({detail})"
        return f"engine.command, engine.args or {prefix}.args ({detail})"
    return prefix


def run(
    experiment: Experiment, names: list[str] | None = None, probe: bool = True, environ: dict[str, str] | None = None
) -> Report:
    """The preflight of ``names`` (default: every configuration); ``probe`` False skips the user's engine."""
    environ = dict(os.environ if environ is None else environ)
    report = Report()
    names = names or list(experiment.configurations)
    engine = engines.get(experiment.engine.kind)
    tiny = experiment.tiny_model_spec() is not None
    if engine.loads_checkpoint():
        ckpt = checkpoint.locate(experiment.model.path, built_by_pipeline=tiny)
    else:
        ckpt = checkpoint.Checkpoint(experiment.model.path, None, None, None, local=True)
    memory = host_checks.gpu_memory()
    _run_wide(experiment, report, engine, ckpt, environ)
    if memory is not None:
        report.findings += _gpu_model_findings(experiment, names, memory)
    report.findings += _chat_template_findings(experiment, ckpt)
    launches = _launches(experiment, names, report)
    answers = engine.preflight(launches, ckpt.config, PROBE_TIMEOUT_S if probe else None)
    for name, launch in launches.items():
        found, facts = answers[name]
        for f in found:
            report.findings.append(Finding(f.level, name, key_of(experiment, name, f.where), f.message))
        checked = ["the launch flags and environment", *facts.pop("checked", [])]
        if ckpt.config is not None:
            checked.append("the checkpoint's config.json")
        if launch.gpus and memory is not None:
            checked.append(f"GPUs {list(launch.gpus)}")
            missing = sorted(set(launch.gpus) - set(memory))
            if missing:
                message = f"GPU(s) {missing} are not on this host (nvidia-smi lists {sorted(memory)})"
                report.findings.append(Finding("error", name, f"configurations.{name}.gpus", message))
            if facts.get("cuda_devices") is not None:
                checked.append("the GPUs a CUDA process sees in the server's environment")
                for problem in host_checks.visible_gpu_findings(launch.gpus, memory, facts["cuda_devices"]):
                    report.findings.append(Finding("error", name, f"configurations.{name}.gpus", problem))
            report.findings += _memory_findings(
                experiment, engine, name, launch, memory, ckpt.weights_bytes, ckpt.config
            )
        report.checked[name] = checked
        if facts:
            report.facts[name] = facts
    return report


def _launches(experiment: Experiment, names: list[str], report: Report) -> dict[str, engines.ServerLaunch]:
    """How each configuration's server would be started; a launch that cannot be built: a finding on ``report``."""
    launches = {}
    for name in names:
        conf = experiment.configuration(name)
        spec = experiment.launch_spec(name)
        runtime = server.Runtime.from_config(experiment.operations, conf)
        try:
            argv, env = server.launch_command(spec, runtime, runtime.port_range[0])
        except ServerError as exc:  # the API key's variable unset: said as a finding, the others still checked
            report.findings.append(Finding("error", name, "engine.api_key_env", str(exc)))
            continue
        # The GPUs the server will get (inside a Slurm job, those Slurm gave it), not the config's numbers.
        launches[name] = engines.ServerLaunch(argv, env, list(runtime.gpus), spec["speculative"])
    return launches


def _memory_findings(
    experiment: Experiment,
    engine: engines.Engine,
    name: str,
    launch: engines.ServerLaunch,
    memory: dict[int, host_checks.GpuMemory],
    weights_bytes: int | None,
    checkpoint_config: dict[str, Any] | None,
) -> list[Finding]:
    """Whether the configuration's GPUs have the memory its server claims, its weights need, and its KV pool one
    request of its full length needs."""
    claim = engine.gpu_memory_claim(launch.argv)
    # servegrid's own server of another configuration on these GPUs is stopped before this one starts.
    ours = own_servers_on(experiment, name, launch.gpus)
    level = "warning" if ours else "error"
    findings = []
    for problem in host_checks.memory_findings(launch.gpus, memory, weights_bytes, claim):
        said = (
            f"{problem} (servegrid's own server of {', '.join(ours)} holds it now: stopped first)" if ours else problem
        )
        findings.append(Finding(level, name, f"configurations.{name}.gpus", said))
    kv = engine.kv_demand(launch.argv, checkpoint_config)
    if kv is not None:
        for kv_level, problem in host_checks.kv_pool_findings(launch.gpus, memory, weights_bytes, claim, kv):
            # Whatever else holds the GPU now, the pool is what the claim leaves after the weights.
            findings.append(Finding(kv_level, name, key_of(experiment, name, "args:--max-model-len"), problem))
    return findings


def _gpu_model_findings(
    experiment: Experiment, names: list[str], memory: dict[int, host_checks.GpuMemory]
) -> list[Finding]:
    """A warning where the configurations compared head to head run on different GPU models (issue 42): part of
    their difference would be the cards'."""
    models = {
        name: " + ".join(memory[i].name for i in gpus)
        for name in names
        if (gpus := experiment.configuration(name).gpus) and all(i in memory for i in gpus)
    }
    if len(set(models.values())) <= 1:
        return []
    said = "; ".join(f"{name} on GPU(s) {list(experiment.configuration(name).gpus)}: {m}" for name, m in models.items())
    message = (
        f"the configurations run on different GPU models ({said}): part of any difference between them is the cards'"
    )
    return [Finding("warning", None, "configurations.*.gpus", message)]


def _chat_template_findings(experiment: Experiment, ckpt: checkpoint.Checkpoint) -> list[Finding]:
    """A mode that sends through the chat endpoint, on a checkpoint without a chat template and no --chat-template:
    vLLM answers every chat request with HTTP 400 (transformers keeps no default template since 4.44)."""
    chatting = [name for name in experiment.workloads if modes.get(name).uses_chat]
    if not chatting or ckpt.folder is None or checkpoint.has_chat_template(ckpt.folder):
        return []
    given = ["engine.args"] if any(a.split("=")[0] == "--chat-template" for a in experiment.engine.args) else []
    given += [
        f"configurations.{n}.args"
        for n, c in experiment.configurations.items()
        if any(a.split("=")[0] == "--chat-template" for a in c.args)
    ]
    if given:
        return []
    return [
        Finding(
            "error",
            None,
            "model.path",
            f"{ckpt.source} has no chat template (chat_template.jinja, or tokenizer_config.json's chat_template), and "
            f"workloads.{chatting[0]} sends through the chat endpoint: vLLM would answer each of its requests with "
            "HTTP 400; give the server one (--chat-template in engine.args) or drop that workload",
        )
    ]


def _run_wide(
    experiment: Experiment, report: Report, engine: engines.Engine, ckpt: checkpoint.Checkpoint, environ: dict[str, str]
) -> None:
    """The checks made once for the run: proxies, the checkpoint's presence and size, the GPUs' presence."""
    host = experiment.operations.host
    reaching = host_checks.proxies_reaching(host, environ)
    if reaching:
        report.findings.append(
            Finding(
                "error",
                None,
                "environment: no_proxy",
                f"{', '.join(reaching)} set and no_proxy does not name {host}: the health checks, metrics and warm-ups "
                f"would go through that proxy and a healthy server would time out (set no_proxy={host},localhost)",
            )
        )
    overlap = host_checks.ephemeral_overlap(experiment.operations.port_range)
    if overlap:
        report.findings.append(Finding("warning", None, "operations.port_range", overlap))
    if any(c.gpus for c in experiment.configurations.values()) and host_checks.gpu_memory() is None:
        report.unchecked.append(
            "GPUs: no nvidia-smi on this host (the GPUs' presence and free memory are checked "
            "where the servers run: run servegrid preflight there)"
        )
    if ckpt.built_by_pipeline:
        report.unchecked.append(
            f"model: {ckpt.source} is built by the pipeline (model.tiny); its config.json is read once it exists"
        )
    elif ckpt.refused:
        report.findings.append(Finding("error", None, "model.path", ckpt.refused))
    elif not ckpt.local:
        folder, free = checkpoint.cache_free_bytes()
        if ckpt.weights_bytes is None:
            report.findings.append(
                Finding(
                    "error" if not checkpoint.is_repo_id(ckpt.source) else "warning",
                    None,
                    "model.path",
                    f"{ckpt.source} is not on this machine, and its size is unknown ({ckpt.why_unknown}); the first "
                    "server start would download it inside operations.startup_timeout_s",
                )
            )
        elif ckpt.weights_bytes > free:
            report.findings.append(
                Finding(
                    "error",
                    None,
                    "model.path",
                    f"{ckpt.source} is not on this machine; its weights ({host_checks.gib(ckpt.weights_bytes)}) are "
                    f"more than the {host_checks.gib(free)} free under {folder} (HF_HUB_CACHE)",
                )
            )
        else:
            report.findings.append(
                Finding(
                    "warning",
                    None,
                    "model.path",
                    f"{ckpt.source} is not on this machine: the first server start downloads "
                    f"{host_checks.gib(ckpt.weights_bytes)} inside operations.startup_timeout_s (and each "
                    f"configuration starting at once would too); download it first: hf download {ckpt.source}",
                )
            )
    if ckpt.config is None and not ckpt.built_by_pipeline:
        report.unchecked.append(
            "the checkpoint's config.json (not on this machine): its MTP layers and the engine's configuration"
        )


def own_servers_on(experiment: Experiment, name: str, gpus: Sequence[int]) -> list[str]:
    """Other configurations whose servegrid server is live on any of ``gpus`` (their memory is not another user's)."""
    runtime = server.Runtime.from_config(experiment.operations, experiment.configuration(name))
    return sorted(
        other
        for other, record in state.records(runtime).items()
        if other not in (name, state.GATEWAY) and set(record.get("gpus") or []) & set(gpus) and state.live(record)
    )
