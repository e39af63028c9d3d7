# `make test` works on a fresh machine: it creates .venv, installs the pinned dependencies, makes sure a
# redis-server binary exists (installing it with apt when it can), and runs the whole CPU suite.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test venv redis-server bench clean help

help:
	@echo "make test    - create .venv, install pinned deps, ensure redis-server, run the CPU test suite"
	@echo "make bench   - run the hook benchmark (bench/hooks_bench.py)"
	@echo "make clean   - remove .venv and caches"

$(STAMP): requirements.lock requirements-nodeps.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	# verl without its (much larger) declared dependency set: requirements.lock holds what we import of it.
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.lock
	$(PY) -m pip install --quiet --no-deps -e .
	@touch $(STAMP)

venv: $(STAMP)

redis-server:
	@if command -v redis-server >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "redis-server missing: installing it with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
		command -v redis-server >/dev/null 2>&1 || { echo "error: apt-get did not provide redis-server" >&2; exit 1; }; \
	else \
		echo "error: redis-server is not installed and cannot be installed here (needs root and apt-get)." >&2; \
		echo "       Install the redis-server package (Redis >= 6.2), then run 'make test' again." >&2; \
		exit 1; \
	fi

test: venv redis-server
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: venv redis-server
	$(PY) bench/hooks_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
