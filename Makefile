# sglang-kvcr: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv when it is missing (or stale) and reuse it otherwise.
SHELL := /bin/bash
PY_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.sglang-kvcr-stamp
INTEROP_VENV := .venv-interop
INTEROP_STAMP := $(INTEROP_VENV)/.dynamo-stamp
HARNESS := $(CURDIR)/test/cpu_harness
# Everything that runs SGLang or KVCR here: loopback only, quiet NIXL, scratch caches.
export UCX_NET_DEVICES := lo
export NIXL_LOG_LEVEL := WARN
export SGLANG_KVCR_CACHE_DIR ?= $(CURDIR)/.cache
export PYTHONPATH := $(HARNESS)/pythonpath$(if $(PYTHONPATH),:$(PYTHONPATH))
PYTEST_ARGS ?=

.PHONY: venv test demo validate bench faults interop interop-venv lint wheel install-check clean-venv

venv: $(STAMP)

# torch==2.13.0 is the first line of requirements/cpu.txt, so the CPU build is pinned
# in the same pip command as everything that depends on torch. sglang and
# sglang-kernel go in with --no-deps: their metadata pins CUDA-only packages.
$(STAMP): requirements/cpu.txt pyproject.toml
	test -x $(PY) || $(PY_BOOT) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -r requirements/cpu.txt
	$(PIP) install -q --disable-pip-version-check --no-deps sglang==0.5.23 sglang-kernel==0.4.10
	$(PIP) install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, kvcr, sglang; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The main job, phase by phase (about 2-3 minutes on 2 cores).
demo: $(STAMP)
	$(PY) test/manual/kvcr_direct_linker/kvcr_demo.py

# The full validation: the demo's checks plus the MLA and sliding-window family
# round trips, and the metrics each server moved.
validate: $(STAMP)
	$(PY) test/manual/kvcr_direct_linker/kvcr_validate.py

faults: $(STAMP) $(INTEROP_STAMP)
	$(PY) test/manual/kvcr_direct_linker/kvcr_faults.py

# NVIDIA Dynamo's selection service (ai-dynamo-runtime 1.6.1) in its own venv:
# its pydantic pin conflicts with SGLang's. It runs as a child process of the
# interop driver; nothing of it is imported into .venv.
interop-venv: $(INTEROP_STAMP)

$(INTEROP_STAMP):
	test -x $(INTEROP_VENV)/bin/python || $(PY_BOOT) -m venv $(INTEROP_VENV)
	$(INTEROP_VENV)/bin/pip install -q --disable-pip-version-check ai-dynamo-runtime==1.6.1
	$(INTEROP_VENV)/bin/python -c "from dynamo.llm import SelectionService"
	touch $(INTEROP_STAMP)

# Dynamo picks the peer and writes the hint; two CPU linker workers (about 2 min).
interop: $(STAMP) $(INTEROP_STAMP)
	$(PY) test/manual/kvcr_direct_linker/kvcr_interop.py

bench: $(STAMP)
	$(PY) test/manual/kvcr_direct_linker/kvcr_microbench.py

# This package's wheel (pure Python) in dist/, for `pip install --no-deps` next to
# an existing SGLang 0.5.23 (docs/kvcr_direct_linker.md, "Install").
wheel: $(STAMP)
	$(PIP) wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w dist .
	@ls dist/sglang_kvcr-*.whl

# The docs' install commands, run as written in a scratch venv (about a minute;
# not part of `make test`).
install-check: $(STAMP)
	$(PY) -m pytest -m install test/registered/unit/mem_cache/kvcr/tooling/test_kvcr_install.py $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check python test examples
	$(VENV)/bin/mypy

clean-venv:
	rm -rf $(VENV)
