# Meridian: `make up` starts the demo fleet, `make test` runs the suite.
# Both create .venv and install the project on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test proto lint bench browser clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/meridian up $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerates common/gen from proto/ (tests fail when the two disagree).
proto: $(STAMP)
	$(PY) -m common.protogen

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench.pick_time

# Debian's headless Chromium and its WebDriver, for the dashboard test (apt, as root or sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
		echo "chromium and chromedriver are installed"; \
	else \
		$(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install \
			-y -q --no-install-recommends chromium chromium-driver; \
	fi

clean:
	rm -rf $(VENV) build *.egg-info
