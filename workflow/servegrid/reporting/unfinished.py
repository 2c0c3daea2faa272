"""What a run that ended with an error left unmeasured, and why: the last lines Snakemake prints on a failed run
(``onerror``), so a user back at a long GPU run sees which configurations failed and where to read, not only
Snakemake's list of failed jobs. In English, like the terminal summary."""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from servegrid import paths
from servegrid.analysis import top_ups
from servegrid.config import Experiment
from servegrid.errors import ServegridError
from servegrid.records.cell_spec import CellSpec
from servegrid.serving import procs, state
from servegrid.serving.state import Runtime

# Why a cell's job failed, as its log says: servegrid's one error line (errors.guarded), else an uncaught
# exception's last line.
REPEATED = "(failed earlier in this run"  # servegrid.serving.server: a later cell of a spec that failed to start
_SERVEGRID_ERROR = re.compile(r"servegrid: error: (.+)")
_EXCEPTION = re.compile(r"^[\w.]+(?:Error|Exception|Interrupt)\b.*")


def text(experiment: Experiment, runtime: Runtime, owner: procs.ProcessRef | None) -> str:
    """The configurations with cells left unmeasured, each with its count and its reason: the failed start this run
    recorded (``owner``'s), else the last error line of one of its cells' logs; then the top-ups a round decided and
    the run did not measure (sampling.policy: verdict), the same way. Empty when nothing is left."""
    left: dict[str, list[CellSpec]] = defaultdict(list)
    for cell in experiment.cells():
        if not Path(cell.path).exists():
            left[cell.configuration].append(cell)
    top_ups_left = _top_ups_left(experiment)
    if not left and not top_ups_left:
        return ""
    lines = [
        "servegrid: the run ended with cells left unmeasured (measured cells are kept; a rerun measures the rest):"
    ]
    for configuration, cells in left.items():
        total = len(experiment.cells(configuration))
        why = _why(cells, runtime, owner, _cell_log)
        lines.append(f"  {configuration}: {len(cells)} of {total} cells not measured; {why}")
    for (round_, configuration), cells in top_ups_left.items():
        why = _why(cells, runtime, owner, functools.partial(_top_up_log, round_))
        lines.append(f"  {configuration}: {len(cells)} top-up(s) of round {round_} not measured; {why}")
    return "\n".join(lines)


def _top_ups_left(experiment: Experiment) -> dict[tuple[int, str], list[CellSpec]]:
    """(round, configuration) → the cells whose top-up that round's decision asks for and no file holds yet."""
    left: dict[tuple[int, str], list[CellSpec]] = defaultdict(list)
    grid = {cell.id: cell for cell in experiment.cells()}
    for round_ in range(1, (experiment.top_up_rounds or 0) + 1):
        decided = Path(paths.decision(round_))
        if not decided.exists():
            break
        try:
            listed = top_ups.top_ups_listed(decided)
        except ServegridError:  # a damaged decision file: the run's own error says so
            break
        for cell in top_ups.cells_of_round(listed, grid):
            if not Path(cell.top_up_path(round_)).exists():
                left[round_, cell.configuration].append(cell)
    return left


def _why(
    cells: list[CellSpec], runtime: Runtime, owner: procs.ProcessRef | None, log_of: Callable[[CellSpec], str]
) -> str:
    failure = state.read(state.failure_path(runtime, cells[0].configuration))
    if failure and owner is not None and failure.get("owner") == owner.to_dict():
        first = str(failure.get("message", "")).splitlines()[0] if failure.get("message") else "no message"
        return f"its server failed to start: {first}"
    said = []
    for cell in cells:
        log = Path(log_of(cell))
        reason = _last_error(log)
        if reason:
            said.append(f"{reason} ({log})")
    # A cell that only repeats an earlier cell's failure says less than that cell.
    first_hand = [s for s in said if not s.startswith(REPEATED)]
    return (first_hand or said or ["not reached (the run stopped first, or these jobs did not run)"])[0]


def _cell_log(cell: CellSpec) -> str:
    return paths.CELL_LOG_PATTERN.format(**_wildcards(cell))


def _top_up_log(round_: int, cell: CellSpec) -> str:
    return paths.TOP_UP_LOG_PATTERN.format(**_wildcards(cell), round=round_)


def _wildcards(cell: CellSpec) -> dict[str, object]:
    return {"configuration": cell.configuration, "mode": cell.mode, "context": cell.context, "load": cell.load.label}


def _last_error(log: Path) -> str | None:
    try:
        text_lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(text_lines):
        said = _SERVEGRID_ERROR.search(line)
        if said:
            return said[1].strip()[:300]
    return next((line.strip()[:300] for line in reversed(text_lines) if _EXCEPTION.match(line.strip())), None)
