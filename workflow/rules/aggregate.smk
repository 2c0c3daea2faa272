"""All cells of the current grid → Parquet tables."""


rule aggregate:
    input:
        cells=all_cells(),
        stops=all_server_stops(),
        # Sampling that serves the verdict: every round's top-ups, and the last round's decisions (none otherwise).
        top_ups=lambda wildcards: (
            top_ups_before(last_round()) if EXPERIMENT.top_up_rounds else []
        ),
        decisions=[paths.decision(last_round())] if EXPERIMENT.top_up_rounds else [],
    output:
        # Every table of the run (servegrid.paths.RunTables): the job hands these very paths to the aggregation.
        **RUN_TABLES.named(),
    log:
        "results/logs/aggregate.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        verdict_rules=as_params(EXPERIMENT.verdict),
        validity=as_params(EXPERIMENT.validity),
        slo=canonical_json(EXPERIMENT.raw["slo"]),
        # The production table's prices (servegrid.analysis.cost).
        cost=canonical_json(EXPERIMENT.raw.get("cost")),
        # Pairs, ties and the production winner follow the configurations' order.
        order=CONFIGURATIONS,
        # Which route's phases the verdict comes from, and whether the gateway's cost is computed.
        route=EXPERIMENT.route,
    script:
        "../scripts/aggregate.py"
