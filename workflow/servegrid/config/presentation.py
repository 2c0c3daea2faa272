"""What figures and reports show of the configuration besides the measured data: the declared inputs (params) of
those rules alone, so that editing a label or the title reruns exactly the figures or the reports, never a cell."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from servegrid import redact
from servegrid.config.grid import OPEN_LOOP_KEYS
from servegrid.config.sections import localized, rule_fields

if TYPE_CHECKING:
    from servegrid.config.sections import (
        Configuration,
        EngineSection,
        ExperimentInfo,
        ModelSection,
        Operations,
        VerdictRules,
        Workload,
    )
    from servegrid.stats.sampling import SamplingRule


class Presentation:
    """The presentation part of :class:`servegrid.config.experiment.Experiment` (its base: the sections it reads
    are the experiment's)."""

    raw: Mapping[str, Any]
    info: ExperimentInfo
    model: ModelSection
    engine: EngineSection
    configurations: dict[str, Configuration]
    workloads: dict[str, Workload]
    sampling_rules: Mapping[str, SamplingRule | None]
    operations: Operations
    verdict: VerdictRules
    route: str
    report_baseline: str | None

    # The experiment's own (servegrid.config.experiment.Experiment, this class's one subclass).
    def modes(self) -> list[str]:
        raise NotImplementedError

    def workload(self, mode: str) -> Workload:
        raise NotImplementedError

    def configuration(self, name: str) -> Configuration:
        raise NotImplementedError

    def configuration_flags(self, name: str) -> list[str]:
        raise NotImplementedError

    def gateway_identity(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def label(self, name: str, lang: str) -> str:
        """A configuration's label in ``lang``."""
        return localized(self.configuration(name).label, lang)

    def title(self, lang: str) -> str:
        return localized(self.info.title, lang)

    def baseline(self) -> str:
        """The configuration the others are compared with in the ratio figure: report.baseline, else the first."""
        return self.report_baseline or next(iter(self.configurations))

    def figure_presentation(self) -> dict[str, Any]:
        """What the figures show of the configuration besides the measured data (labels, colours and
        markers by configuration order, the baseline): a declared input (params) of the figure rule."""
        return {
            "configurations": {name: {"label": c.label} for name, c in self.configurations.items()},
            "configuration_order": list(self.configurations),
            "baseline": self.baseline(),
            "modes": self.modes(),
            # Which figures exist and which panels the goodput figure has.
            "slo": self.raw["slo"],
            "route": self.route,  # the gateway's figure exists with route: both
        } | self._traces()

    def _traces(self) -> dict[str, Any]:
        """A replayed trace's identity, where a mode replays one (its shape is drawn from the trace itself): absent
        otherwise, so that a run without a trace keeps its params."""
        traces = {
            m: w.settings["trace"]
            | ({"windows": {label: own["trace"] for label, own in w.windows.items()}} if any(w.windows) else {})
            for m, w in self.workloads.items()
            if "trace" in w.settings
        }
        return {"traces": traces} if traces else {}

    def presentation(self) -> dict[str, Any]:
        """What the report shows of the configuration besides the measured data: a declared input
        (params) of the report rule, so that editing a label or the title reruns exactly the reports."""
        return {
            "title": self.info.title,
            "hardware": self.info.hardware,
            "model": self.model.path,
            "tiny_model": self.model.tiny is not None,
            "engine": self.engine.kind,
            "engine_args": redact.argv(self.engine.args),
            "configurations": {
                # Not its GPUs: placement is shown from what each server recorded, and reruns nothing.
                name: {"label": c.label, "flags": redact.argv(self.configuration_flags(name))}
                for name, c in self.configurations.items()
            },
            # The report lists configurations in the config's order; the mapping above may be stored sorted.
            "configuration_order": list(self.configurations),
            "baseline": self.baseline(),
            "slo": self.raw["slo"],  # the objectives the production section prints
            "workloads": {mode: self.workload_view(mode) for mode in self.workloads},
            "sampling": {mode: rule_fields(self.sampling_rules[mode]) for mode in self.workloads},  # the rules shown
            "min_factor": self.verdict.min_factor,
            "goodput_share": self.verdict.goodput_share,  # the open-loop section says it
            "client_cpus": list(self.operations.client_cpus),
            # The section "through the gateway": its topology and the gateway's settings (no key).
            "route": self.route,
            "gateway": self.gateway_identity(),
            # The prices the production section states (a run without a cost: section keeps its params as they were).
            **({"cost": self.raw["cost"]} if self.raw.get("cost") is not None else {}),
        }

    def workload_view(self, mode: str) -> dict[str, Any]:
        w = self.workload(mode)
        view = {**w.settings, "contexts": list(w.contexts), "concurrency": list(w.concurrency)}
        if w.rates:  # only where there are open-loop cells: a report without them keeps its params
            view |= {"rates": list(w.rates), **{k: dict(w.open_loop[k]) for k in OPEN_LOOP_KEYS}}
        if w.speedups:
            view |= {"speedups": list(w.speedups), "open_loop": dict(w.open_loop["open_loop"])}
        if w.windows:  # what each window replays (the report names them): absent for a mode without windows
            view |= {"windows": {label: cell_workload["trace"] for label, cell_workload in w.windows.items()}}
        return view
