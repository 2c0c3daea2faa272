"""The settings of every cell of the repo's configs, byte for byte as 47f9ef4 (before the cell format's version)
computed them: they are the cell rule's params, so a byte changed there re-measures that cell on every GPU host.
tests/data/golden/cell-settings-47f9ef4.json was written by tests/helpers/settings_golden.py run on a checkout of
47f9ef4 (PYTHONPATH=<checkout>/workflow). A deliberate change of what a cell measures updates the file and says
so in its commit."""

from __future__ import annotations

import json

import pytest

from helpers import REPO
from helpers.settings_golden import CONFIGS, settings_by_config

GOLDEN = json.loads((REPO / "tests" / "data" / "golden" / "cell-settings-47f9ef4.json").read_text())


@pytest.fixture(scope="module")
def today() -> dict[str, dict[str, str]]:
    return settings_by_config(REPO)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_cells_settings_are_byte_for_byte_as_before(config, today):
    assert sorted(today[config]) == sorted(GOLDEN[config])  # the same cells
    changed = [path for path, settings in today[config].items() if settings != GOLDEN[config][path]]
    assert not changed, f"{len(changed)} cell(s) of {config} would be measured again, e.g. {changed[0]}"


def test_the_golden_file_covers_every_kind_of_cell():
    settings = [json.loads(s) for cells in GOLDEN.values() for s in cells.values()]
    kinds = {(s["mode"], "rate" in s, "speedup" in s) for s in settings}
    modes = {mode for mode, _, _ in kinds}
    assert {"decode", "single_turn", "multi_turn", "trace"} <= modes
    assert any(rate for _, rate, _ in kinds) and any(speedup for _, _, speedup in kinds)
