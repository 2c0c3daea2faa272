"""All cells of the current grid → Parquet tables."""


rule aggregate:
    input:
        cells=all_cells(),
        stops=all_server_stops(),
    output:
        requests=paths.REQUESTS_TABLE,
        summary=paths.SUMMARY_TABLE,
        servers=paths.SERVERS_TABLE,
        comparisons=paths.COMPARISONS_TABLE,
        verdict=paths.VERDICT_TABLE,
        crossovers=paths.CROSSOVERS_TABLE,
        production=paths.PRODUCTION_TABLE,
        gateway=paths.GATEWAY_TABLE,
        gateway_verdict=paths.GATEWAY_VERDICT_TABLE,
    log:
        "results/logs/aggregate.log",
    conda:
        "../../envs/pipeline.yaml"
    params:
        verdict_rules=as_params(EXPERIMENT.verdict),
        validity=as_params(EXPERIMENT.validity),
        slo=canonical_json(EXPERIMENT.raw["slo"]),
        # Pairs, ties and the production winner follow the configurations' order.
        order=CONFIGURATIONS,
        # Which route's phases the verdict comes from, and whether the gateway's cost is computed.
        route=EXPERIMENT.route,
    script:
        "../scripts/aggregate.py"
