"""Configuration, the grid, and the helpers every rule file uses."""

import os
from dataclasses import asdict
from pathlib import Path

from servegrid import paths
from servegrid import server as servers
from servegrid.config import Experiment, canonical_json
from servegrid.figure_list import figure_paths
from servegrid.procs import ProcessRef
from servegrid.schema import read_yaml

# Snakemake's YAML loader keeps the last of a key given twice, silently: read each file
# again, strictly, so that a duplicated configuration fails naming its line.
for configfile in workflow.config_settings.configfiles or ["config.yaml"]:
    read_yaml(configfile)

# Validated against workflow/schemas/config.schema.yaml (with each workload mode's own
# settings from its module) before any job runs; an error names the key.
EXPERIMENT = Experiment(
    config,
    source=", ".join(str(p) for p in workflow.config_settings.configfiles)
    or "config.yaml",
)
CONFIGURATIONS = list(EXPERIMENT.configurations)
LANGUAGES = EXPERIMENT.languages
REPORT_TEMPLATES = sorted(
    str(p) for p in Path("report/templates").rglob("*") if p.is_file()
)

# Servers that this run's cells start belong to this Snakemake process: their
# supervisors take them down if it disappears, even by SIGKILL.
os.environ[servers.OWNER_ENV] = servers.owner_token(ProcessRef.of(os.getpid()))


wildcard_constraints:
    configuration="|".join(CONFIGURATIONS),
    mode="|".join(EXPERIMENT.modes()),
    context=r"\d+",
    concurrency=r"\d+",
    lang="|".join(LANGUAGES),


def cell_of(wildcards):
    return EXPERIMENT.cell(
        wildcards.configuration,
        wildcards.mode,
        int(wildcards.context),
        int(wildcards.concurrency),
    )


def cell_settings(wildcards):
    """The cell's own slice of the config: changing anything else reruns nothing."""
    return canonical_json(EXPERIMENT.cell_settings(cell_of(wildcards)))


def launch_spec(wildcards):
    # Secrets masked: params are stored in .snakemake/metadata; the cell launches with the real values.
    return canonical_json(EXPERIMENT.public_launch_spec(wildcards.configuration))


def cells_of_configuration(wildcards):
    return [cell.path for cell in EXPERIMENT.cells(wildcards.configuration)]


def all_cells():
    return [cell.path for cell in EXPERIMENT.cells()]


def all_server_stops():
    return [paths.server_stop(name) for name in CONFIGURATIONS]


def as_params(section):
    """A typed config section as a declared input of a rule (a stable string)."""
    return canonical_json(asdict(section))


def device_slots():
    """Snakemake resources that keep one cell per device at a time: gpu<i> for every GPU a
    configuration names, cpu_server for configurations without GPUs. Their limits (1 each)
    come from the workflow profile profiles/default, which Snakemake loads by itself."""

    def uses(gpu):
        return lambda wildcards: int(
            gpu in EXPERIMENT.configuration(wildcards.configuration).gpus
        )

    indices = sorted({g for c in EXPERIMENT.configurations.values() for g in c.gpus})
    slots = {f"gpu{i}": uses(i) for i in indices}
    slots["cpu_server"] = lambda wildcards: int(
        not EXPERIMENT.configuration(wildcards.configuration).gpus
    )
    return slots


# Snakemake runs the highest priority ready job first: per configuration, its
# server_spec, its cells, then its server_stop, before the next configuration.
# So each server starts at most once per run, and is stopped before the next one
# needs the machine.
def cell_priority(wildcards):
    return 1000 - 3 * EXPERIMENT.configuration_index(wildcards.configuration)


def spec_priority(wildcards):
    return cell_priority(wildcards) + 1


def stop_priority(wildcards):
    return cell_priority(wildcards) - 1


def model_inputs(wildcards):
    return [] if EXPERIMENT.tiny_model_spec() is None else [EXPERIMENT.model.path]


def stop_all_servers(reason):
    """Last line of teardown: every server this Snakemake process started."""
    runtime = servers.Runtime.from_config(EXPERIMENT.operations)
    for outcome in servers.stop_all(
        runtime, owner=ProcessRef.of(os.getpid()), reason=reason
    ):
        if outcome["was_running"]:
            print(f"servegrid: stopped server session {outcome['session']} ({reason})")
