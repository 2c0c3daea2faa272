"""The gateway in front of the servers: a LiteLLM proxy servegrid starts, or an existing one (``proxy.url``).

The seed measured through a LiteLLM proxy that spread its traffic over the GPU servers; many teams deploy
vLLM that way. With ``route: proxy`` or ``both`` a cell's requests go through it (servegrid.measuring.measured_phase).

A proxy servegrid starts is one process per host, in the state folder as :data:`servegrid.serving.state.GATEWAY`,
beside the servers: the same supervisor, owner watch, host claims and teardown (``onsuccess``/``onerror``,
``servegrid server down``), so it never outlives the pipeline either. Its ``model_list`` has one model per
configuration whose server is up, named as the configuration, forwarding to that server; a server that
starts on a new port changes that list, and the proxy is started again with the new one (LiteLLM reads
its config once; ~9 s here). It is started lazily, by the first cell that needs it.

Its config file holds no secret: the master key and any upstream key are ``os.environ/VARIABLE``
references that LiteLLM resolves from the environment it inherits.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from servegrid import atomic, redact
from servegrid.config import Experiment, spec_hash
from servegrid.config.sections import ProxySection
from servegrid.control_http import control_client
from servegrid.errors import GatewayError, ServerError
from servegrid.serving import launch, procs, server, state

log = logging.getLogger(__name__)

# LiteLLM fetches a model price map from the internet at import unless told to use its bundled copy.
PROXY_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "INFO"}
# LiteLLM's openai-compatible provider: it forwards token-id prompts and vLLM's extra sampling fields
# (min_tokens, ignore_eos). Its hosted_vllm provider refused token-id prompts (1.106.12: "Unmapped prompt
# format"), so every completion cell would have failed.
UPSTREAM_PROVIDER = "openai"


@dataclass(frozen=True)
class GatewayFacts:
    """The gateway a proxied request goes through, as a cell file records it (no secret)."""

    url: str
    started_by_servegrid: bool
    kind: str = "litellm"
    version: str | None = None
    session: str | None = None
    log_path: str | None = None
    startup_s: float | None = None
    model_list: list[dict[str, Any]] | None = None  # as configured, secrets as os.environ/ references

    def model(self, configuration: str, proxy: ProxySection) -> str:
        """The model name that reaches ``configuration``'s server through this gateway."""
        return (proxy.models or {}).get(configuration, configuration)


class LiteLLMProbe:
    """How :func:`servegrid.serving.launch.wait_healthy` knows the proxy is up, and that it is the one just launched."""

    health_path = "/health/liveliness"  # no key needed, no upstream called

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers

    names_path = "/v1/models"

    def served_names(self, client: httpx.Client, url: str) -> list[str]:
        response = client.get(f"{url}{self.names_path}", headers=self.headers)
        return self.names(response.content) if response.status_code == 200 else []

    @staticmethod
    def names(body: bytes) -> list[str]:
        try:
            return [str(m.get("id", "")) for m in json.loads(body).get("data") or []]
        except (ValueError, AttributeError, TypeError):
            return []


def master_key(proxy: ProxySection) -> str:
    key = os.environ.get(proxy.master_key_env)
    if not key:
        raise GatewayError(
            f"proxy.master_key_env names {proxy.master_key_env}, but that variable is not set: the gateway's "
            "key comes from the environment only (e.g. export it, or `make demo-proxy` sets one)"
        )
    return key


def headers(proxy: ProxySection) -> dict[str, str]:
    """The bearer token every request to the gateway carries."""
    return {"Authorization": f"Bearer {master_key(proxy)}"}


def model_list(experiment: Experiment, upstreams: dict[str, str], identity: str | None = None) -> list[dict]:
    """LiteLLM's model_list: one model per configuration in ``upstreams`` (name → server url), plus, where given,
    ``identity``: the launch's own name, as the servers have one (launch.identity), checked before use."""
    proxy = experiment.proxy
    assert proxy is not None
    key_env = experiment.engine.api_key_env
    params = {
        "model": f"{UPSTREAM_PROVIDER}/{experiment.model.served_name}",
        # LiteLLM insists on an upstream key; vLLM without --api-key takes any.
        "api_key": f"os.environ/{key_env}" if key_env else "none",
        **dict(proxy.model_params or {}),
    }
    entries: list[dict[str, Any]] = [
        {"model_name": name, "litellm_params": {**params, "api_base": f"{url}/v1"}}
        for name, url in sorted(upstreams.items())
    ]
    if identity and entries:
        entries.append({"model_name": identity, "litellm_params": dict(entries[0]["litellm_params"])})
    return entries


def proxy_config(experiment: Experiment, upstreams: dict[str, str], identity: str) -> dict[str, Any]:
    proxy = experiment.proxy
    assert proxy is not None
    return {
        "model_list": model_list(experiment, upstreams, identity),
        "general_settings": {"master_key": f"os.environ/{proxy.master_key_env}"},
    }


def installed_version(proxy: ProxySection) -> str:
    """The LiteLLM version that proxy.command runs: asked of the Python beside it."""
    command = Path(proxy.command[0])
    python = command.parent / "python"
    if not python.exists():
        raise GatewayError(
            f"proxy.command: cannot tell which LiteLLM {command} runs (no {python}); run `make setup`, which "
            "installs the pinned version into .venv-litellm"
        )
    done = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise GatewayError(f"proxy.command: {python} has no LiteLLM ({done.stderr.strip()[-300:]}); run `make setup`")
    return done.stdout.strip()


def upstreams(runtime: server.Runtime, configurations: list[str]) -> dict[str, str]:
    """The configurations whose server is up on this host now, with its url."""
    live = {}
    for name in configurations:
        record, facts = state.read(state.record_path(runtime, name)), state.read(state.facts_path(runtime, name))
        if record and facts and state.supervised(record) and record.get("session") == facts.get("session"):
            live[name] = facts["url"]
    return live


def ensure(
    experiment: Experiment,
    configuration: str,
    runtime: server.Runtime,
    owner: procs.ProcessRef | None,
    cpus: Sequence[int] = (),
) -> GatewayFacts:
    """A gateway that reaches ``configuration``'s server (whose server must be up): the existing one at
    proxy.url, or servegrid's own proxy, reused when its model_list still matches the servers that are up,
    else started (again), confined to ``cpus`` (empty: wherever the caller may run). The caller holds the
    gateway's lease (:func:`lease`)."""
    proxy = experiment.proxy
    if proxy is None:
        raise GatewayError("route goes through a gateway, but there is no proxy: section")
    if proxy.url is not None:
        master_key(proxy)
        return GatewayFacts(url=proxy.url.rstrip("/"), started_by_servegrid=False, kind=proxy.kind)
    with state.locked(runtime):
        live = upstreams(runtime, list(experiment.configurations))
        if configuration not in live:
            raise GatewayError(f"the gateway was asked for configuration '{configuration}', whose server is not up")
        wanted = spec_hash({"argv": [*proxy.command, *proxy.args], "models": model_list(experiment, live)})
        record = state.read(state.record_path(runtime, state.GATEWAY))
        facts = state.read(state.facts_path(runtime, state.GATEWAY))
        if record and state.supervised(record) and record["spec_hash"] == wanted and facts:
            if _healthy(record, proxy):
                return GatewayFacts(**facts)
            log.warning("gateway session %s does not answer as itself: replaced", record["session"])
        if record and state.anything_running(record):
            reason = "its servers changed" if record.get("spec_hash") != wanted else "replaced"
            server.stop_record(record, runtime, reason=f"gateway {reason}")
        launched = _launch(experiment, proxy, live, wanted, runtime, owner, list(cpus))
    # Its wait for health outside the state lock: the servers' decisions go on meanwhile (the caller's gateway
    # lease keeps other cells from starting or stopping it).
    return _finish_start(experiment, proxy, live, runtime, launched)


def lease(runtime: server.Runtime) -> Any:
    """Held by a cell while it measures through the gateway: the gateway is not restarted under it, and two
    cells never share it at once (each would add the other's load to what it calls the gateway's cost)."""
    return state.lease(state.GATEWAY, runtime)


def _healthy(record: dict[str, Any], proxy: ProxySection) -> bool:
    try:
        with control_client(5.0) as client:
            names = LiteLLMProbe(headers(proxy)).served_names(client, record["url"])
    except httpx.HTTPError:
        return False
    return launch.identity(record["session"]) in names


@dataclass(frozen=True)
class _Launched:
    key: str
    version: str
    session: str
    url: str
    record_path: Path
    log_path: Path
    argv: list[str]
    runtime: server.Runtime
    started: float
    started_at: str


def _launch(
    experiment: Experiment,
    proxy: ProxySection,
    live: dict[str, str],
    wanted: str,
    runtime: server.Runtime,
    owner: procs.ProcessRef | None,
    cpus: list[int],
) -> _Launched:
    key = master_key(proxy)  # before anything starts: a missing key fails at once
    version = installed_version(proxy)
    if proxy.version is not None and version != proxy.version:
        raise GatewayError(
            f"proxy.version is {proxy.version}, but {proxy.command[0]} runs LiteLLM {version}: run `make setup` "
            "(envs/litellm.txt pins the version) or change proxy.version"
        )
    session = launch.new_session()
    identity = launch.identity(session)
    config = proxy_config(experiment, live, identity)
    config_path = state.directory(runtime) / f"{state.GATEWAY}.{session}.yaml"
    atomic.write_text(config_path, yaml.safe_dump(config, sort_keys=False))
    # No GPU; its cores set by its supervisor (a cell job has narrowed its own to the client's by now).
    gateway_runtime = server.Runtime(**{**asdict(runtime), "gpus": [], "cpus": cpus})
    started = time.monotonic()
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def argv_and_env(port: int) -> tuple[list[str], dict[str, str]]:
        argv = [*proxy.command, "--config", str(config_path), "--host", runtime.host, "--port", str(port), *proxy.args]
        return argv, dict(PROXY_ENV)

    ports = range(proxy.port, min(proxy.port + 100, 65536))
    url, record_path, log_path, argv, _ = launch.launch_supervised(
        state.GATEWAY, wanted, gateway_runtime, owner, session, ports, argv_and_env
    )
    return _Launched(key, version, session, url, record_path, log_path, argv, gateway_runtime, started, started_at)


def _finish_start(
    experiment: Experiment, proxy: ProxySection, live: dict[str, str], runtime: server.Runtime, up: _Launched
) -> GatewayFacts:
    try:
        launch.wait_healthy(
            LiteLLMProbe({"Authorization": f"Bearer {up.key}"}),
            "the gateway (LiteLLM proxy)",
            up.url,
            {},
            up.record_path,
            up.log_path,
            (proxy.startup_timeout_s, "proxy.startup_timeout_s"),
            launch.identity(up.session),
            "gateway",
        )
    except BaseException as exc:
        with state.locked(runtime):
            record = state.read(up.record_path)
            if record and record.get("session") == up.session:
                server.stop_record(record, up.runtime, reason="start-up failed")
        if isinstance(exc, ServerError) and not isinstance(exc, GatewayError):
            raise GatewayError(str(exc)) from None
        raise
    facts = GatewayFacts(
        url=up.url,
        started_by_servegrid=True,
        kind=proxy.kind,
        version=up.version,
        session=up.session,
        log_path=str(up.log_path),
        startup_s=round(time.monotonic() - up.started, 3),
        model_list=[{**e, "litellm_params": redact.env(e["litellm_params"])} for e in model_list(experiment, live)],
    )
    state.write(state.facts_path(runtime, state.GATEWAY), asdict(facts))
    log.info(
        "gateway %s up at %s in %.1f s (started %s), serving %s",
        up.version,
        up.url,
        facts.startup_s,
        up.started_at,
        ", ".join(sorted(live)),
    )
    log.debug("gateway argv: %s", json.dumps(redact.argv(up.argv)))
    return facts
