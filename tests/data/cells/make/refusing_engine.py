"""An engine that dies of its own error at its first request, for a refused cell: prints the commit's own recorded
vLLM engine death (FIXTURE_TESTDATA/vllm_0_32_engine_death.log) to the server log, then runs the commit's
calibration server with its first generation request (the start-up warm-up) failing with HTTP 500."""

import os
import sys
from pathlib import Path

sys.stdout.write((Path(os.environ["FIXTURE_TESTDATA"]) / "vllm_0_32_engine_death.log").read_text())
sys.stdout.flush()
os.execv(sys.executable, [sys.executable, "-m", "servegrid.testing.calibration", *sys.argv[1:], "--fault", "1=500"])
