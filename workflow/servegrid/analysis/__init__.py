"""Cell files → the run's tables: the per-request table, the per-cell summary, the verdict, the service-level
objectives and the gateway's cost."""
