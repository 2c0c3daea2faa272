"""Before the first GPU hour: what the host and the user's engine would refuse (``preflight``), and what the run
will cost (``estimate``). Reads the config, asks the engine and the host; starts no server."""
