"""The tiny random-weight model of CPU demos and tests (only when model.tiny is set)."""


if EXPERIMENT.raw["model"]["tiny"]:

    rule tiny_model:
        output:
            directory(EXPERIMENT.raw["model"]["path"]),
        params:
            tiny=canonical_json(EXPERIMENT.raw["model"]["tiny"]),
        log:
            "results/logs/tiny_model.log",
        script:
            "../scripts/build_model.py"
