# Meridian: `make up` starts the demo fleet, `make test` runs the suite.
# Both create .venv and install the project on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := proto/inference/grpc_service.proto proto/meridian/v1/capacity.proto

.PHONY: up test proto lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/meridian up $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Generated code lives in common/gen; protoc's virtual path mapping makes the
# generated imports absolute (common.gen.inference...).
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Icommon/gen=proto --python_out=. --pyi_out=. \
		--grpc_python_out=. $(patsubst proto/%,common/gen/%,$(PROTOS))

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) build *.egg-info
