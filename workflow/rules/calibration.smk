"""The calibration pass (servegrid.pipeline.calibration_pass): `snakemake calibrate`, then
`servegrid estimate` prices the run from it. Not in the report's DAG: a run needs none.

A calibration is kept with its server spec and is redone when the spec changes, and
only then (so no params: which cells it probes is the calibration's own choice, and it
records them); `servegrid calibrate --force NAME` redoes one by hand.
"""


rule calibration:
    input:
        spec=paths.SERVER_SPEC_PATTERN,
    output:
        paths.CALIBRATION_PATTERN,
    log:
        paths.CALIBRATION_LOG_PATTERN,
    priority: spec_priority
    conda:
        "../../envs/pipeline.yaml"
    resources:
        **device_slots(),
        **slurm_job(calibration_runtime_s, keeps_the_server=True),
    script:
        "../scripts/calibrate.py"


rule calibrate:
    input:
        expand(paths.CALIBRATION_PATTERN, configuration=CONFIGURATIONS),
