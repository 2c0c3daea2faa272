"""The experiment as configured: ``config.yaml`` read strictly, validated by schema and by the checks a schema
cannot express, turned into typed sections and the grid of cells.

What the rest of the package and the tests use is re-exported here; inside ``config/`` each module imports
its siblings directly.
"""

from servegrid.config.experiment import (
    MEASUREMENT_VERSION,
    CellSpec,
    ClassRule,
    Configuration,
    Experiment,
    Operations,
    Validity,
    VerdictRules,
    Workload,
    canonical_json,
    spec_hash,
)

__all__ = [
    "MEASUREMENT_VERSION",
    "CellSpec",
    "ClassRule",
    "Configuration",
    "Experiment",
    "Operations",
    "Validity",
    "VerdictRules",
    "Workload",
    "canonical_json",
    "spec_hash",
]
