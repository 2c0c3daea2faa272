"""A configuration's calibration: what one short server session measured about the cost of its cells
(servegrid.pipeline.calibration_pass writes it, servegrid.planning.estimate reads it).

Kept beside the server spec (``results/servers/<configuration>/calibration.json``) and valid for that spec only:
``spec_hash`` says which server it measured, and an estimate ignores a calibration of another spec. Each probe is one
cell of the grid measured to a fixed count: its primary figure's values (whose spread decides how many samples a cell
of the sequential rule needs), its measuring seconds and rounds, and what its job took beyond measuring. A
configuration its engine refuses has no probe: the engine's reason and what the refusal took.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servegrid import atomic
from servegrid.errors import CellFileError, NewerFormatError

# read() reads every version written: 1 (2026-12-07), 2 (adds ``refused``; a file of format 1 was never refused)
FORMAT_VERSION = 2


@dataclass(frozen=True)
class Probe:
    """One grid cell measured by the calibration."""

    mode: str
    context: int
    concurrency: int
    rounds: int  # rounds of the measured phase (one unit per session each)
    measuring_s: float  # the measured phase's seconds
    job_s: float  # the probe's whole run: server reuse check, warm-up, prompts, measuring, file
    values: list[float]  # the primary figure, one per sample (the mode's Primary.column)

    @property
    def round_s(self) -> float:
        return self.measuring_s / max(1, self.rounds)


@dataclass(frozen=True)
class Calibration:
    configuration: str
    spec_hash: str
    measured_at: str
    startup_s: float  # the server session's start to healthy, warm-up included
    job_start_s: float  # a cell job's interpreter start: Python and servegrid's imports
    probes: list[Probe] = field(default_factory=list)
    # The engine's reason where it refused the configuration (it died of its own error at its first request, or in a
    # probe): no probes; ``startup_s`` is then what the refusal took (servegrid's two starts).
    refused: str | None = None
    format_version: int = FORMAT_VERSION

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def write(path: Path | str, calibration: Calibration) -> None:
    atomic.write_json(path, calibration.as_json())


def read(path: Path | str) -> Calibration:
    """A calibration of any format written; :class:`NewerFormatError` for a newer one, :class:`CellFileError` naming
    the file for one that cannot be read."""
    try:
        raw: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
        version = int(raw.get("format_version", 0))
        if version > FORMAT_VERSION:
            raise NewerFormatError(f"{path}: a calibration of format {version}, written by a newer servegrid")
        probes = [Probe(**probe) for probe in raw.pop("probes", [])]
        return Calibration(**raw, probes=probes)
    except (OSError, ValueError, TypeError) as exc:
        raise CellFileError(f"{path}: cannot read the calibration ({exc}); delete it to calibrate again") from exc
