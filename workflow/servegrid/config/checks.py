"""The checks the config schema cannot express, run on every :class:`~servegrid.config.Experiment`
before anything else: each failure is a :class:`ConfigError` naming the key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from servegrid import engines, modes, redact
from servegrid.config.sections import (
    Configuration,
    EngineSection,
    ExperimentInfo,
    ModelSection,
    Operations,
    ProxySection,
    Workload,
)
from servegrid.config.tiny_model_spec import TinyModelSpec, check_replaceable
from servegrid.errors import ConfigError
from servegrid.languages import available_languages


class Experiment(Protocol):
    """What the checks read of an experiment. Declared here rather than imported: the experiment runs these checks
    on itself as it is built (:class:`servegrid.config.experiment.Experiment` implements it)."""

    source: str
    info: ExperimentInfo
    model: ModelSection
    engine: EngineSection

    # Read-only (properties): a protocol's plain attribute is invariant, and the experiment's are dicts.
    @property
    def configurations(self) -> Mapping[str, Configuration]: ...
    @property
    def workloads(self) -> Mapping[str, Workload]: ...

    operations: Operations
    route: str
    proxy: ProxySection | None
    languages: list[str]
    report_baseline: str | None


def check(experiment: Experiment) -> None:
    src = experiment.source
    try:
        if not any("{model}" in part for part in experiment.engine.command):
            raise ConfigError("engine.command: needs a '{model}' placeholder where the model goes")
        engines.get(experiment.engine.kind).check_config(
            experiment.engine.args,
            {f"configurations.{n}.args": c.args for n, c in experiment.configurations.items()},
            {"engine.env": experiment.engine.env or {}}
            | {f"configurations.{n}.env": c.env or {} for n, c in experiment.configurations.items()},
            tiny_model=_tiny_model_weights(experiment),
            host=experiment.operations.host,
        )
        _no_secret_values(experiment)
        _loads(experiment)
        _context_limits(experiment)
        if experiment.model.tiny is not None:
            check_replaceable(experiment.model.path)  # before Snakemake could delete a real model's folder
        if not experiment.workloads:
            raise ConfigError("workloads: no workload mode is enabled")
        missing = [lang for lang in experiment.languages if lang not in available_languages()]
        if missing:
            raise ConfigError(
                f"report.languages: no catalogue for {', '.join(missing)} "
                "(add report/locales/<language>/LC_MESSAGES/messages.po)"
            )
        _languages_covered(experiment)
        _gateway(experiment)
        baseline = experiment.report_baseline
        if baseline is not None and baseline not in experiment.configurations:
            raise ConfigError(
                f"report.baseline: '{baseline}' is not a configuration (known: {', '.join(experiment.configurations)})"
            )
        low, high = experiment.operations.port_range
        if low > high:
            raise ConfigError(f"operations.port_range: {low} > {high}")
    except ConfigError as exc:
        raise ConfigError(f"{src}: {exc}") from None


def _context_limits(experiment: Experiment) -> None:
    """A cell whose requests cannot fit the server's context limit (where the config states it) is refused
    now, not after a server started and every request came back HTTP 400."""
    engine = engines.get(experiment.engine.kind)
    for name, conf in experiment.configurations.items():
        limit = engine.context_limit([*experiment.engine.args, *conf.args])
        if limit is None:
            continue
        for mode, workload in experiment.workloads.items():
            # Every window of a trace with its drain: the longest request must fit whichever cell sends it.
            for context, settings in ((c, s) for c in workload.contexts for s in workload.variants()):
                need = modes.get(mode).request_tokens(context, settings)
                where = modes.get(mode).longest_where
                if need > limit and where is not None:
                    raise ConfigError(
                        f"workloads.{mode}: {where(settings)} holds {need} tokens (prompt + output), more "
                        f"than the {limit} that configuration '{name}' allows (its context limit in engine.args or "
                        f"configurations.{name}.args); cut the trace or its windows"
                    )
                if need > limit:
                    raise ConfigError(
                        f"workloads.{mode}.contexts: at context {context} a request holds about {need} tokens, "
                        f"more than the {limit} that configuration '{name}' allows "
                        f"(its context limit in engine.args or configurations.{name}.args)"
                    )


def _loads(experiment: Experiment) -> None:
    """Each mode has sessions or rates to measure; rates only where the mode runs open loop."""
    for mode, workload in experiment.workloads.items():
        if not workload.concurrency and not workload.rates and not workload.speedups:
            raise ConfigError(f"workloads.{mode}: neither concurrency nor rates: the mode has no cell to measure")
        if not workload.rates:
            continue
        if not modes.get(mode).open_loop:
            open_modes = ", ".join(m for m in modes.names() if modes.get(m).open_loop)
            raise ConfigError(
                f"workloads.{mode}.rates: {mode} runs closed-loop sessions only (open loop: {open_modes})"
            )


def _languages_covered(experiment: Experiment) -> None:
    """A text given per language must be given in every report language."""
    texts = {"experiment.title": experiment.info.title}
    texts |= {f"configurations.{n}.label": c.label for n, c in experiment.configurations.items()}
    for key, text in texts.items():
        if isinstance(text, str):
            continue
        missing = [lang for lang in experiment.languages if lang not in text]
        if missing:
            raise ConfigError(
                f"{key}: no text for {', '.join(missing)} (report.languages); give one per language or one string"
            )


# Published with malicious code (a credential stealer, 2026-03-24; BerriAI/litellm#24512): never run.
COMPROMISED_LITELLM = ("1.82.7", "1.82.8")
RESERVED_PROXY_FLAGS = ("--config", "--host", "--port", "--api_base", "--model")


def _no_secret_values(experiment: Experiment) -> None:
    """A secret's value never sits in the config: Snakemake copies the whole config into each job's script under
    .snakemake/scripts/, which a killed run (``kill -9``) leaves on disk. The server inherits the environment
    servegrid runs in, so an exported variable reaches it without the config naming it."""
    where = {"engine.env": experiment.engine.env or {}} | {
        f"configurations.{n}.env": c.env or {} for n, c in experiment.configurations.items()
    }
    for key, variables in where.items():
        for name in variables:
            if redact.is_secret_name(name):
                raise ConfigError(
                    f"{key}.{name}: a secret's value does not go in the config (Snakemake copies the config into its "
                    f"job scripts, which a killed run leaves on disk): export {name} in the environment you run "
                    "servegrid from instead; the servers inherit it"
                )


def _gateway(experiment: Experiment) -> None:
    """route needs proxy; a proxy servegrid starts runs a version that is not a compromised one, with no flag
    servegrid sets itself; an existing gateway names a model for known configurations only."""
    proxy = experiment.proxy
    if experiment.route != "direct" and proxy is None:
        raise ConfigError(f"route: '{experiment.route}' goes through a gateway, but there is no proxy: section")
    if proxy is None:
        return
    if proxy.version in COMPROMISED_LITELLM:
        raise ConfigError(
            f"proxy.version: LiteLLM {proxy.version} was published with malicious code (1.82.7 and 1.82.8); "
            "use the version envs/litellm.txt pins"
        )
    for arg in proxy.args:
        flag = arg.split("=", 1)[0]
        if flag in RESERVED_PROXY_FLAGS:
            raise ConfigError(f"proxy.args: '{flag}' is set by servegrid (the proxy's config, host and port)")
    for name, value in (proxy.model_params or {}).items():
        if redact.is_secret_name(name) and not (isinstance(value, str) and value.startswith("os.environ/")):
            raise ConfigError(
                f'proxy.model_params.{name}: a secret goes in as "os.environ/VARIABLE" (LiteLLM reads the variable), '
                "never as its value: the proxy's config is a file"
            )
    unknown = sorted(set(proxy.models or {}) - set(experiment.configurations))
    if unknown:
        raise ConfigError(f"proxy.models: no configuration named {', '.join(unknown)}")
    if proxy.models and proxy.url is None:
        raise ConfigError("proxy.models: only read with proxy.url (servegrid names the models of a proxy it starts)")


def _tiny_model_weights(experiment: Experiment) -> str | None:
    """None (the user's model), "dummy" (model.tiny, no weight files) or "weights" (model.tiny writes them)."""
    if experiment.model.tiny is None:
        return None
    spec = TinyModelSpec(**experiment.model.tiny)
    spec.check()  # before anything runs: the model rule would refuse it only once the pipeline started
    return "weights" if spec.writes_weights else "dummy"
