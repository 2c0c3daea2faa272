"""The config a run planned with, for the jobs it submits: a queued job measures that, not a later edit.

A Slurm job (or any job Snakemake runs in a Snakemake of its own) parses the Snakefile again and reads the config
files from disk when it starts, which for a queued job may be hours after submission. Had the user edited
``config.yaml`` meanwhile, the job would measure the edited workload while the submitting Snakemake's tables and
report describe the planned one, and nothing would say so. The submitting Snakemake therefore writes the config it
parsed to ``results/.plans/<id>.json`` and passes the id to its jobs in the environment (the Slurm executor submits
with the environment exported, as it does for the server owner); a job with an id reads that plan instead of the
files and logs which key was edited since. The next run sees the edit in each cell's params and measures it.

A plan file carries its format: ``{"format_version": 2, "config": ...}``; format 1 (before 2026-12-06) is the bare
config. A plan of a newer format is refused (:class:`NewerFormatError`): a newer servegrid planned that run.

The config never holds a secret (config.checks refuses them: Snakemake already copies the config into each job's
script on disk), so writing it down adds no exposure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from servegrid import atomic, paths
from servegrid.config.experiment import canonical_json
from servegrid.errors import ConfigError, NewerFormatError

PLAN_ENV = "SERVEGRID_PLAN"
# 1: the bare config (before 2026-12-06); 2: {"format_version": 2, "config": the config}.
PLAN_FORMAT = 2
# Set by a job's Snakemake that replays a plan whose files were edited since: the first edited key, for the job's log.
EDITED_ENV = "SERVEGRID_PLAN_EDITED"


def edited_note(environ: Mapping[str, str]) -> str | None:
    """What a job's log says when its run's config files were edited after the run planned them."""
    edited = environ.get(EDITED_ENV)
    if not edited:
        return None
    return (
        f"the config was edited after this run planned it ({edited}); this job measures what was planned "
        f"({paths.PLANS_DIR}/{environ.get(PLAN_ENV, '?')}.json), the next run measures the edit"
    )


def plan_id(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:16]


def plan_path(identifier: str, root: str | Path = ".") -> Path:
    return Path(root) / paths.PLANS_DIR / f"{identifier}.json"


def write(config: Mapping[str, Any], root: str | Path = ".") -> str:
    """Write the config as planned (once per distinct config) and return its id."""
    identifier = plan_id(config)
    path = plan_path(identifier, root)
    if not path.exists():  # the same config planned again: already written
        atomic.write_json_if_absent(path, {"format_version": PLAN_FORMAT, "config": json.loads(canonical_json(config))})
    return identifier


def read(identifier: str, root: str | Path = ".") -> dict[str, Any]:
    """The planned config of id ``identifier``; a ConfigError if it is gone or is not what that id names."""
    path = plan_path(identifier, root)
    try:
        planned = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: the config this job was planned with is gone (results/ deleted while the run was queued?); "
            f"start the run again, or unset {PLAN_ENV} to run this job on the config files as they are now"
        ) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: the planned config cannot be read ({exc})") from None
    planned = _config_of(path, planned)
    if not isinstance(planned, dict) or plan_id(planned) != identifier:
        raise ConfigError(f"{path}: does not hold the config its name says (edited by hand?); start the run again")
    return planned


def _config_of(path: Path, content: Any) -> Any:
    """The config a plan file of any format holds."""
    if not isinstance(content, dict) or "format_version" not in content:
        return content  # format 1: the bare config
    version = content["format_version"]
    if not isinstance(version, int) or version > PLAN_FORMAT:
        raise NewerFormatError(
            f"{path}: a plan of format {version}, written by a newer servegrid (this one reads formats 1 to "
            f"{PLAN_FORMAT}): run this job with the servegrid that planned it"
        )
    return content.get("config")


def first_difference(planned: Any, now: Any) -> str | None:
    """The first key (dotted, sorted order) whose value differs, as ``key: planned X, now Y``; None if equal."""
    return next(differences(planned, now), None)


def summary(planned: Any, now: Any, shown: int = 3) -> str | None:
    """Up to ``shown`` differing keys, then how many more; None if equal."""
    found = list(differences(planned, now))
    if not found:
        return None
    more = f"; and {len(found) - shown} more" if len(found) > shown else ""
    return "; ".join(found[:shown]) + more


def differences(planned: Any, now: Any, key: str = "") -> Iterator[str]:
    """Each key (dotted, sorted order) whose value differs, as ``key: planned X, now Y``."""
    if isinstance(planned, Mapping) and isinstance(now, Mapping):
        for name in sorted(set(planned) | set(now), key=str):
            where = f"{key}.{name}" if key else str(name)
            if name not in now:
                yield f"{where}: planned {_shown(planned[name])}, now absent"
            elif name not in planned:
                yield f"{where}: absent when planned, now {_shown(now[name])}"
            else:
                yield from differences(planned[name], now[name], where)
    elif isinstance(planned, list) and isinstance(now, list) and len(planned) == len(now):
        for index, (a, b) in enumerate(zip(planned, now, strict=True)):
            yield from differences(a, b, f"{key}[{index}]")
    # JSON's own equality: a planned tuple read back as a list is no edit
    elif json.loads(canonical_json(planned)) != json.loads(canonical_json(now)):
        yield f"{key or '(the whole config)'}: planned {_shown(planned)}, now {_shown(now)}"


def _shown(value: Any) -> str:
    text = canonical_json(value)
    return text if len(text) <= 80 else text[:77] + "..."
