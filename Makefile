# Everything installs inside the project: .venv/ (Python), node_modules/ (the CDK CLI).
# `make demo` and `make test` each set everything up on a fresh machine, then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CDK := node_modules/.bin/cdk
STAMP := $(VENV)/.installed
# PyTorch lives in a virtual environment of its own (TensorFlow, MXNet and PyTorch never share a process).
TORCH_VENV := .venv-torch
TORCH_STAMP := $(TORCH_VENV)/.installed
TORCH_PYTEST := $(TORCH_VENV)/bin/python -m pytest --confcutdir=tests/torch
# checkov has an environment of its own too (its exact pins would downgrade boto3; requirements-checkov.txt).
CHECKOV_VENV := .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.installed
DEB_PACKAGES := iproute2 procps
export PATH := $(CURDIR)/$(BIN):$(CURDIR)/node_modules/.bin:$(PATH)
export TF_CPP_MIN_LOG_LEVEL := 2
export CDK_DISABLE_CLI_TELEMETRY := true
# jsii (aws-cdk-lib's Python bridge) warns on every import, as raw bytes, that Node 20 is past end of life.
export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1
export JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION := 1
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 14,16,18,20
export PIP_DISABLE_PIP_VERSION_CHECK := 1
CDK_FLAGS := --no-notices --no-version-reporting
PYTEST := $(BIN)/python -m pytest

BENCHES := synth checkpoint agent elastic boot move sweep
.PHONY: setup system-deps test test-unit test-fast demo synth $(addprefix bench-,$(BENCHES)) bench-notice clean

# The four environments are independent: a fresh setup builds them at the same time (pip and npm wait
# on the network and the disk much of the time; one after the other they took about 4.5 minutes).
setup:
	@$(MAKE) --no-print-directory -j4 system-deps $(STAMP) $(TORCH_STAMP) $(CHECKOV_STAMP) $(CDK)

# A warning, not a stop: the environments take about 5 GiB (.venv 3.4, .venv-torch 1.2) and a test run
# about 3 GiB more under /tmp; a full disk otherwise shows up only as pip's "No space left on device".
system-deps:
	@scripts/install-system-deps.sh $(DEB_PACKAGES)
	@for dir in . $${TMPDIR:-/tmp}; do free=$$(df -Pk "$$dir" | awk 'NR==2 {print int($$4 / 1048576)}'); \
	  [ "$${free:-0}" -ge 8 ] || echo "make setup: warning: $${free:-0} GiB free under $$dir; setup and the tests need about 8 GiB" >&2; done

$(STAMP): requirements.txt requirements-agent.txt requirements-dev.txt requirements-train.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt -r requirements-train.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

# torch==2.13.0: its CPU build lies in the machine's local wheel directory (requirements-torch.txt says why).
$(TORCH_STAMP): requirements-torch.txt pyproject.toml
	test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(TORCH_VENV)/bin/python -m pip install -q -r requirements-torch.txt
	$(TORCH_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

$(CHECKOV_STAMP): requirements-checkov.txt
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install -q -r requirements-checkov.txt
	$(CHECKOV_VENV)/bin/python -m pip check
	touch $@

$(CDK): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# TensorFlow, MXNet and PyTorch never share a process: the MXNet tests run in a pytest of their
# own, the PyTorch tests in one of the PyTorch environment (--confcutdir: tests/conftest.py needs boto3).
# `make test` (what CI runs) is every tier; each pytest prints its 30 slowest tests.
# The main tests run on two pytest-xdist workers, a test file to a worker (--dist loadfile: a module's
# fixtures, such as one synthesized template, are built once); each worker has its own moto server, and
# every drill its own work dir, ports and network namespaces. Their tests spend much of their time
# waiting on agents, servers and the CDK CLI. The MXNet and PyTorch runs (one after the other, about
# 11 minutes) run beside them; their output is kept in files and printed after the main run's, and
# `make test` fails when any of the three fails.
MAIN_WORKERS ?= 2
DURATIONS := --durations=30
test: setup
	@logs=$$(mktemp -d "$${TMPDIR:-/tmp}/spot-training-tests.XXXXXX"); \
	( $(PYTEST) tests/mxnet $(DURATIONS) > $$logs/mxnet.log 2>&1; echo $$? > $$logs/mxnet.rc; \
	  $(TORCH_PYTEST) tests/torch $(DURATIONS) > $$logs/torch.log 2>&1; echo $$? > $$logs/torch.rc ) & side=$$!; \
	trap 'pkill -TERM -P $$side 2>/dev/null; kill $$side 2>/dev/null' INT TERM; \
	echo "== main tests on $(MAIN_WORKERS) workers (MXNet and PyTorch tests run beside them, logs in $$logs)"; \
	$(PYTEST) tests --ignore=tests/mxnet --ignore=tests/torch -n $(MAIN_WORKERS) --dist loadfile $(DURATIONS); main=$$?; \
	wait $$side; \
	echo "== MXNet tests (ran beside the main tests; exit $$(cat $$logs/mxnet.rc))"; cat $$logs/mxnet.log; \
	echo "== PyTorch tests (ran beside the main tests; exit $$(cat $$logs/torch.rc))"; cat $$logs/torch.log; \
	[ $$main -eq 0 ] && [ "$$(cat $$logs/mxnet.rc)" = 0 ] && [ "$$(cat $$logs/torch.rc)" = 0 ]

# The quick loop: the unit tier only (in-process; tests/tier_guard.py fails a test that starts a process,
# opens a connection or builds a CDK construct without being marked integration or slow).
UNIT := -m "not slow and not integration" -q
test-unit: setup
	TEST_TIER=unit $(PYTEST) tests --ignore=tests/mxnet --ignore=tests/torch --ignore=tests/infra $(UNIT)
	TEST_TIER=unit $(PYTEST) tests/mxnet $(UNIT)
	TEST_TIER=unit $(TORCH_PYTEST) tests/torch $(UNIT)

# Unit and integration tiers, no end-to-end drills or real training runs.
test-fast: setup
	$(PYTEST) tests --ignore=tests/mxnet --ignore=tests/torch -m "not slow"
	$(PYTEST) tests/mxnet -m "not slow"
	$(TORCH_PYTEST) tests/torch -m "not slow"

synth: setup
	$(CDK) synth $(CDK_FLAGS) --quiet
	@ls -l cdk.out/*.template.json

# The main job: deploy SpotTraining with the real CDK CLI to a local moto server, train through
# 3 spot interruptions (one moves the volume to another AZ), destroy, report (out/demo/).
demo: setup
	$(BIN)/spot-train local drill --work-dir out/demo

# make bench-NAME runs bench/bench_NAME.py (one rule for all: each prints a LAST LINE of JSON).
# bench-boot: boot -> first training step of a local node by phase (agent start, volume, dataset, environment, trainer import,
# restore, first step), trainer's environment cold (built) and warm (reused); docs/operations.md has the figures.
# bench-move: the bytes a move across AZs copies, with and without a periodic snapshot (local EBS block model).
# bench-sweep: a sweep of 4, 8, 16 children on local AWS Batch: wall time, submit -> first step, lost steps per reclaim.
$(addprefix bench-,$(BENCHES)): bench-%: setup
	$(BIN)/python bench/bench_$*.py

# bench-notice: the phase drill: notices sent as the agent sends them, per front-end and phase (bench/bench_notice.py;
# each front-end's trials run in a process of its own environment, bench/notice/).
bench-notice: setup
	$(BIN)/python bench/bench_notice.py

clean:
	rm -rf cdk.out out .pytest_cache
