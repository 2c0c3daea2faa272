"""Every cell's settings JSON for the repo's configs, as the code on PYTHONPATH computes them (the golden test of
tests/unit/test_cell_settings_golden.py). Run as a script from a checkout of any commit:

    PYTHONPATH=<checkout>/workflow .venv/bin/python tests/helpers/settings_golden.py <checkout> > golden.json
"""

import json
import sys
from pathlib import Path

import yaml

from servegrid.config import Experiment, canonical_json


def merged(base: dict, extra: dict) -> dict:
    """Snakemake's merge of several --configfile: nested keys updated, others replaced."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


CONFIGS = {
    "config.yaml": ["config.yaml"],
    "cpu-demo": ["config/cpu-demo.yaml"],
    "cpu-demo-proxy": ["config/cpu-demo.yaml", "config/proxy-demo.yaml"],
    "cpu-hybrid-demo": ["config/cpu-hybrid-demo.yaml"],
    "cpu-traffic-demo": ["config/cpu-traffic-demo.yaml"],
}


def settings_by_config(root: Path) -> dict[str, dict[str, str]]:
    """Per config: every cell's path and its settings as the cell rule's params hold them."""
    out = {}
    for name, files in CONFIGS.items():
        raw: dict = {}
        for f in files:
            raw = merged(raw, yaml.safe_load((root / f).read_text()))
        experiment = Experiment(raw)
        out[name] = {cell.path: canonical_json(experiment.cell_settings(cell)) for cell in experiment.cells()}
    return out


if __name__ == "__main__":
    print(json.dumps(settings_by_config(Path(sys.argv[1])), indent=1, sort_keys=True))
