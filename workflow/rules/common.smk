"""Configuration, the grid, and the helpers every rule file uses."""

import os
from dataclasses import asdict
from pathlib import Path

from servegrid import paths
from servegrid.analysis import top_ups
from servegrid.pipeline import slurm
from servegrid.reporting import document, figure_files, terminal_summary, unfinished
from servegrid.serving import server as servers
from servegrid.config import Experiment, canonical_json, plan
from servegrid.errors import ServegridError, ServerError
from servegrid.paths import RunTables
from servegrid.serving.procs import ProcessRef
from servegrid.config.schema import read_yaml
from servegrid.records.cell_spec import LOAD_PATTERN

# A job in a Snakemake of its own (a Slurm job, hours after submission maybe) measures the config its run
# planned, not the files as edited since: servegrid.config.plan.
PLANNED = (
    os.environ.get(plan.PLAN_ENV)
    if workflow.remote_exec or workflow.subprocess_exec
    else None
)
if PLANNED:
    planned = plan.read(PLANNED)
    edited = plan.summary(planned, config)
    config.clear()
    config.update(planned)
    if (
        edited
    ):  # said in each job's own log (servegrid.pipeline.snakemake_jobs), which outlives the Slurm log
        os.environ[plan.EDITED_ENV] = edited
else:
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
# The run's tables, one object for the rules that write and read them and for the jobs they run.
RUN_TABLES = RunTables()
LANGUAGES = EXPERIMENT.languages
REPORT_TEMPLATES = sorted(
    str(p) for p in Path("report/templates").rglob("*") if p.is_file()
)


def inherited_owner():
    """The owner a job's own Snakemake (not the user's) inherits, if that process is alive on this host.

    Inside a Slurm group job, Snakemake starts one Snakemake per job (per cell): owning the server,
    each would take it down as its cell ends, and the next cell would start another. They keep the
    owner they inherit: the group's Snakemake on the node (or, where the node is the submitting
    host, the user's Snakemake), which lives until the group's last job.
    """
    if not (workflow.remote_exec or workflow.subprocess_exec):
        return None
    try:
        return servers.owner_from_env()
    except ServerError:  # not alive here: another host's, or gone
        return None


# Servers that this run's cells start belong to this Snakemake process: their
# supervisors take them down if it disappears, even by SIGKILL.
if inherited_owner() is None:
    os.environ[servers.OWNER_ENV] = servers.owner_token(ProcessRef.of(os.getpid()))

# The submitting Snakemake passes its jobs the id of what it planned (exported with the environment, like the
# owner above); onstart writes the plan down (write_plan), once it is a real run and not a dry one.
if not (workflow.remote_exec or workflow.subprocess_exec):
    os.environ[plan.PLAN_ENV] = plan.plan_id(config)


def write_plan():
    if not (workflow.remote_exec or workflow.subprocess_exec):
        plan.write(config)


wildcard_constraints:
    configuration="|".join(CONFIGURATIONS),
    mode="|".join(EXPERIMENT.modes()),
    context=r"\d+",
    load=LOAD_PATTERN,
    lang="|".join(LANGUAGES),
    round=r"\d+",


def cell_of(wildcards):
    return EXPERIMENT.cell(
        wildcards.configuration,
        wildcards.mode,
        int(wildcards.context),
        wildcards.load,
    )


def cell_settings(wildcards):
    """The cell's own slice of the config: changing anything else reruns nothing."""
    return canonical_json(EXPERIMENT.cell_settings(cell_of(wildcards)))


def launch_spec(wildcards):
    # Secrets masked: params are stored in .snakemake/metadata; the cell launches with the real values.
    return canonical_json(EXPERIMENT.public_launch_spec(wildcards.configuration))


def cells_of_configuration(wildcards):
    """A server stops after its configuration's cells and, under the verdict policy, after the last round's
    decisions and its top-ups: a server kept up between rounds is reused by the next round's top-ups.
    """
    cells = [cell.path for cell in EXPERIMENT.cells(wildcards.configuration)]
    if EXPERIMENT.top_up_rounds is None:
        return cells
    return (
        cells
        + [paths.decision(last_round())]
        + top_ups_before(last_round(), wildcards.configuration)
    )


def all_cells():
    return [cell.path for cell in EXPERIMENT.cells()]


def top_ups_before(round_, configuration=None):
    """The top-ups of rounds 1..round_-1 (of ``configuration``'s cells only, if given): each round's list is known
    once its decision (a checkpoint) is made. None under the precision policy."""
    if EXPERIMENT.top_up_rounds is None:
        return []
    grid = {cell.id: cell for cell in EXPERIMENT.cells(configuration)}
    files = []
    for earlier in range(1, round_):
        decided = checkpoints.decide_round.get(round=earlier).output[0]
        files += [
            cell.top_up_path(earlier)
            for cell in top_ups.cells_of_round(top_ups.top_ups_listed(decided), grid)
        ]
    return files


def last_round():
    """The round that tops nothing up and says how each group stopped."""
    return EXPERIMENT.top_up_rounds + 1


def decision_rule(wildcards):
    """What a round's decisions depend on beyond its cells: the tie band, each mode's ceiling (a cell there is
    not topped up), and whether it is the last round (more rounds rerun only the round that was the last).
    """
    return canonical_json(
        {
            "min_factor": EXPERIMENT.verdict.min_factor,
            "validity": asdict(EXPERIMENT.validity),
            "route": EXPERIMENT.route,
            "last": int(wildcards.round) > EXPERIMENT.top_up_rounds,
            "ceilings": EXPERIMENT.top_up_ceilings,
        }
    )


def top_up_settings(wildcards):
    return canonical_json(
        EXPERIMENT.top_up_settings(cell_of(wildcards), int(wildcards.round))
    )


def all_server_stops():
    return [paths.server_stop(name) for name in CONFIGURATIONS]


def as_params(section):
    """A typed config section as a declared input of a rule (a stable string)."""
    return canonical_json(asdict(section))


def device_slots():
    """Snakemake resources that keep one cell per device at a time: gpu<i> for every GPU a
    configuration names, cpu_server for configurations without GPUs. Their limits (1 each)
    come from the workflow profile profiles/default, which Snakemake loads by itself (it
    replaces any other profile's resources: profiles/slurm cannot change them).

    Under profiles/slurm they also keep a configuration's cells one after another inside its
    group job, which is what makes Snakemake add up their runtime and count its GPUs once
    (servegrid.pipeline.slurm); and configurations that name a common GPU index (or no GPU) wait for
    each other there too, as on one host: distinct indices let Slurm run them side by side.
    """

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


def slurm_job(runtime_s, keeps_the_server=False):
    """What each job of a configuration's group asks Slurm for (only the Slurm executor reads these):
    the configuration's GPUs and CPUs by count (servegrid.serving.placement picks them inside the job) and this
    job's share of the group's time limit, ``runtime_s(wildcards)`` in seconds.

    ``keeps_the_server``: inside the group's allocation Snakemake's jobstep plugin (0.6.x) runs each job as
    an srun step of its own, and under proctrack/cgroup (most clusters) a step's processes die when it
    ends: the server the first cell starts would die with that cell. A job with an ``mpi`` resource it
    runs in the allocation's batch step instead (no srun), whose processes live until the Slurm job ends;
    the empty value asks for no MPI launcher and the submitting plugin ignores it
    (tests/slurm/test_slurm_pipeline.py: one server per configuration's job)."""
    resources = {
        "gpu": lambda wildcards: slurm.gpus(EXPERIMENT, wildcards.configuration),
        "cpus_per_task": lambda wildcards: slurm.cpus_per_task(
            EXPERIMENT, wildcards.configuration
        ),
        "runtime": lambda wildcards: slurm.minutes(runtime_s(wildcards)),
    }
    if keeps_the_server:
        resources["mpi"] = ""
    return resources


def cell_runtime_s(wildcards):
    return slurm.cell_time_limit_s(EXPERIMENT, cell_of(wildcards))


def startup_runtime_s(wildcards):
    # The first cell starts the server; its allowance is booked on the spec, the group's first job.
    return EXPERIMENT.operations.startup_timeout_s + slurm.CELL_OVERHEAD_S


def calibration_runtime_s(wildcards):
    from servegrid.pipeline import calibration_pass

    return calibration_pass.time_limit_s(EXPERIMENT, wildcards.configuration)


def shutdown_runtime_s(wildcards):
    return EXPERIMENT.operations.shutdown_timeout_s + slurm.CELL_OVERHEAD_S


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


# Each top-up round runs the configurations in the order opposite to the round
# before: the server the last one left up serves first, one start saved per round
# where servers take turns (CPU; fewer devices than configurations).
def top_up_priority(wildcards):
    index = EXPERIMENT.configuration_index(wildcards.configuration)
    if int(wildcards.round) % 2:
        index = len(EXPERIMENT.configurations) - 1 - index
    return 1000 - 3 * index


def model_inputs(wildcards):
    return [] if EXPERIMENT.tiny_model_spec() is None else [EXPERIMENT.model.path]


def print_run_summary():
    """The verdict, the invalid cells and the report paths, as the run's last lines (servegrid summary)."""
    try:
        print()
        print(terminal_summary.text(EXPERIMENT))
    except (
        ServegridError,
        OSError,
        ValueError,
    ) as exc:  # a summary that fails never fails the run
        print(f"servegrid: no summary ({exc}); see results/tables/")


def print_unfinished():
    """On a failed run: each configuration with cells left unmeasured, and why (servegrid.reporting.unfinished)."""
    try:
        said = unfinished.text(
            EXPERIMENT,
            servers.Runtime.from_config(EXPERIMENT.operations),
            ProcessRef.of(os.getpid()),
        )
    except (
        ServegridError,
        OSError,
        ValueError,
    ) as exc:  # never hides the run's own error
        said = f"servegrid: no list of what is left ({exc})"
    if said:
        print(said)


def stop_all_servers(reason):
    """Last line of teardown: every server this Snakemake process started."""
    runtime = servers.Runtime.from_config(EXPERIMENT.operations)
    for outcome in servers.stop_all(
        runtime, owner=ProcessRef.of(os.getpid()), reason=reason
    ):
        if outcome["was_running"]:
            print(f"servegrid: stopped server session {outcome['session']} ({reason})")


def report_inputs(wildcards):
    # The tables the report reads, as servegrid.reporting.document declares them.
    return RUN_TABLES.named(document.TABLES_READ) | {
        "figures": figure_files.figure_paths(
            EXPERIMENT, paths.FIGURES_LANG_DIR.format(lang=wildcards.lang)
        ),
        "templates": REPORT_TEMPLATES,
        "catalogue": f"report/locales/{wildcards.lang}/LC_MESSAGES/messages.po",
    }


# The title, hardware, labels, flags and settings the report prints: editing one rebuilds the reports.
REPORT_SHOWN = canonical_json(EXPERIMENT.presentation())
