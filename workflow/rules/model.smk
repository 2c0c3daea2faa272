"""The tiny random-weight model of CPU demos and tests (only when model.tiny is set)."""

if EXPERIMENT.tiny_model_spec() is not None:

    localrules:
        tiny_model,

    rule tiny_model:
        output:
            directory(EXPERIMENT.model.path),
        log:
            "results/logs/tiny_model.log",
        conda:
            "../../envs/pipeline.yaml"
        params:
            tiny=canonical_json(EXPERIMENT.tiny_model_spec()),
        script:
            "../scripts/build_model.py"
