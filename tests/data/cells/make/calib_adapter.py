"""Argument adapter for commits whose calibration server predates vLLM-style flags (before 50cc383): drops the
launch's vLLM flags and runs that commit's own ``python -m servegrid.calibration --host H --port P``."""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", required=True)
args, _ = parser.parse_known_args()
os.execv(sys.executable, [sys.executable, "-m", "servegrid.calibration", "--host", args.host, "--port", args.port])
