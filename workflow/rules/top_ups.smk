"""Sampling that serves the verdict (sampling.policy: verdict; servegrid.analysis.top_ups).

After every cell's first pass, round k decides from the cells and the top-ups of rounds 1..k-1 (its declared inputs
alone) which cells the verdict still needs more of; each is topped up in round k: its measured phase once more, in a
file of its own. The last round (top_up_rounds + 1) only says how each group stopped.
"""


checkpoint decide_round:
    input:
        cells=all_cells(),
        top_ups=lambda wildcards: top_ups_before(int(wildcards.round)),
    output:
        paths.DECISION_PATTERN,
    log:
        "results/logs/decisions/round{round}.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        rule=decision_rule,
    script:
        "../scripts/decide_round.py"


rule top_up:
    input:
        spec=paths.SERVER_SPEC_PATTERN,
    output:
        ensure(paths.TOP_UP_PATTERN, non_empty=True),
    log:
        paths.TOP_UP_LOG_PATTERN,
    priority: top_up_priority
    conda:
        "../../envs/pipeline.yaml"
    resources:
        **device_slots(),
        **slurm_job(cell_runtime_s, keeps_the_server=True),
    params:
        settings=top_up_settings,
    script:
        "../scripts/run_cell.py"
