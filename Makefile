# Two entry points: `make demo` runs kinference end to end on embedded defaults, `make test` runs the tests.
# Each creates its own virtualenv in $(VENV) and installs what it needs. Prerequisite: Python >= 3.11 with venv.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first, from PyTorch's CPU-only index, so that a CPU-only machine never downloads CUDA
# wheels (PyPI's Linux torch is the CUDA build, several GB). On a GPU machine pick a CUDA index instead:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# TORCH_INDEX_URL= (empty) uses pip's own configuration: a mirror, or wheels on disk through find-links. That is
# also what happens on a machine that cannot reach the index at all (it is checked first, with a warning).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
# The suite mostly waits (group joins, timeouts): pytest-xdist runs it in this many processes, each with its own broker.
PYTEST_WORKERS ?= 4
# What runs again on Apache Kafka (KINFERENCE_TEST_BROKER=kafka, jars from Maven Central; needs a JDK 17+ and Maven):
# the end-to-end service, the client, exactly-once (its SIGKILL test needs Kafka's read_committed), rebalances
# (eager, cooperative, KIP-848), crash, shutdown and exit, share groups (KIP-932, Kafka only), offsets with gaps
# (transactional upstreams, compaction: Kafka only), and a generative model's SIGKILL and rebalance mid-stream (the
# rebalance on Kafka only). README: Tests.
KAFKA_TESTS ?= tests/integration/test_service.py tests/integration/test_client.py tests/integration/test_exactly_once.py \
	tests/integration/test_offset_gaps.py tests/faults/test_hostile_input.py \
	tests/faults/test_exactly_once_crash.py tests/faults/test_exactly_once_faults.py tests/faults/test_rebalance.py \
	tests/faults/test_crash.py tests/faults/test_shutdown.py tests/faults/test_exit.py tests/faults/test_share_groups.py \
	tests/faults/test_generate_faults.py tests/faults/test_generate_engine_faults.py

MLSERVER_SPEC ?= mlserver==1.7.1

BIN := $(VENV)/bin
MLSERVER_TYPES := $(VENV)/mlserver-types
STAMP := $(VENV)/.kinference-installed
# Evaluated only when torch is being installed: "--index-url URL" when the index answers, else nothing.
TORCH_SOURCE = $(if $(TORCH_INDEX_URL),$(if $(shell $(PYTHON) -c 'import sys, urllib.request; \
	urllib.request.urlopen(sys.argv[1], timeout=15)' '$(TORCH_INDEX_URL)/' >/dev/null 2>&1 && echo up),\
	--index-url $(TORCH_INDEX_URL),$(warning $(TORCH_INDEX_URL) cannot be reached; torch comes from pip's own configuration)))

.PHONY: install demo test test-tansu test-kafka test-docker test-lowest lint typecheck clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_SOURCE) "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	# MLServer's package, for its pydantic OIP types only (tests/unit/consumer/wire/test_oip.py): kept apart,
	# without its server's dependencies (which would pin protobuf, pandas and others of this venv).
	$(BIN)/pip install --quiet --no-deps --target $(MLSERVER_TYPES) "$(MLSERVER_SPEC)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/kinference demo

# The whole suite on the embedded Tansu broker, then KAFKA_TESTS on Apache Kafka, then the image and the compose stack.
test: test-tansu test-kafka test-docker

# The packaging test installs torch into a fresh venv as `install` does: KINFERENCE_TEST_TORCH tells it how.
test-tansu: $(STAMP)
	HF_HUB_OFFLINE=1 KINFERENCE_TEST_TORCH='$(strip $(TORCH_SOURCE) $(TORCH_SPEC))' \
		KINFERENCE_TEST_MLSERVER=$(MLSERVER_TYPES) $(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m "not docker" \
		$(PYTEST_ARGS)

# Without a JDK and Maven these tests skip, each saying why.
test-kafka: $(STAMP)
	HF_HUB_OFFLINE=1 KINFERENCE_TEST_BROKER=kafka $(BIN)/python -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS) \
		$(KAFKA_TESTS)

# deploy/'s image and compose stack built and run for real (tests/docker), in one process: the builds are heavy and
# each is made once, then reused. They need a Docker engine and Compose v2 (.ci/docker.sh sets both up on Debian), a
# JDK and Maven (Kafka's jars), else they skip, saying why.
test-docker: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n 0 $(PYTEST_ARGS) tests/docker

# The unit tests on the lowest version of every dependency that pyproject.toml allows (their own venv).
test-lowest:
	PYTHON=$(PYTHON) TORCH_SOURCE='$(TORCH_SOURCE)' TORCH_SPEC='$(TORCH_SPEC)' bash .ci/lowest-versions.sh

lint: $(STAMP)
	$(BIN)/ruff check kinference consumer handlers loadgen tests

# mypy, strict on the whole package (kinference/, consumer/, handlers/, loadgen/: [tool.mypy]), on a tree of links
# with the installed layout: the folders at the top of the repository are kinference.consumer, kinference.handlers...
# (pyproject's package-dir).
typecheck: $(STAMP)
	rm -rf .typecheck && mkdir -p .typecheck/kinference
	for f in kinference/*.py consumer handlers loadgen; do ln -s ../../$$f .typecheck/kinference/; done
	cd .typecheck && ../$(BIN)/python -m mypy --config-file ../pyproject.toml -p kinference

clean:
	rm -rf $(VENV) .venv-lowest kinference-demo-output .pytest_cache .typecheck
