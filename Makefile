# treeattn_lab: two commands.
#   make lab   -> .venv with the lab (the package and its "lab" extra: JupyterLab, widgets, plotly), then
#                 JupyterLab on notebooks/ (LAB_ARGS passes options, e.g. LAB_ARGS="--port=8899 --no-browser")
#   make test  -> .venv with the dev extras (the lab's included), then the whole suite (notebooks included);
#                 the suite also checks two bare venvs that hold only what a learner gets: .venv-lab, built by
#                 this Makefile's own `make lab` recipe (VENV=.venv-lab), and .venv-binder, built by Binder's
#                 recipe (binder/requirements.txt, then binder/postBuild); JupyterLab in the browser test
#                 runs from .venv-lab
#
# torch: a torch importable by $(PYTHON) (a cloud GPU notebook) is kept: the venv then sees the system
# site-packages. Otherwise: a CUDA build from PyPI where an NVIDIA GPU is present, else the CPU build
# (a local wheel when pip's find-links has one, else the CPU index) so CPU machines never pull CUDA wheels.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
TORCH_CPU_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PYTEST_ARGS ?=
LAB_ARGS ?=

.PHONY: lab test venv torch browser bare-venvs lint bench-tree clean

$(PY):
	@if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	  echo "[make] $(PYTHON) already has torch: creating $(VENV) on top of its site-packages"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV); \
	fi
	$(PIP) install -q --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored" || true

venv: $(PY)

$(VENV)/.torch: $(PY)
	@if $(PY) -c "import torch" >/dev/null 2>&1; then \
	  echo "[make] keeping torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "[make] NVIDIA GPU found: installing the CUDA build of torch"; \
	  $(PIP) install -q torch; \
	elif $(PIP) install -q --no-deps --no-index "torch==$(TORCH_CPU_VERSION)" >/dev/null 2>&1; then \
	  echo "[make] installed the local CPU wheel of torch $(TORCH_CPU_VERSION); now its dependencies"; \
	  $(PIP) install -q "torch==$(TORCH_CPU_VERSION)" 2>&1 | grep -v "is ignored" || true; \
	else \
	  echo "[make] no GPU: installing the CPU build of torch $(TORCH_CPU_VERSION)"; \
	  $(PIP) install -q "torch==$(TORCH_CPU_VERSION)" --index-url $(TORCH_CPU_INDEX); \
	fi
	@touch $@

torch: $(VENV)/.torch

$(VENV)/.lab: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[lab]" 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import treeattn_lab, jupyterlab, plotly, ipywidgets, anywidget" && touch $@

$(VENV)/.dev: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
	@$(PY) -c "import treeattn_lab, jupyterlab, pytest, hypothesis, nbclient" && touch $@ $(VENV)/.lab

# JupyterLab refuses to start as root unless told; in a container (Binder, Docker, cloud notebooks, CI)
# root is the normal user, so the lab passes --allow-root there and says so.
lab: $(VENV)/.lab
	@if [ "$$(id -u)" = 0 ]; then \
	  echo "[make] running as root (a container?): starting JupyterLab with --allow-root"; \
	  exec $(VENV)/bin/jupyter lab --notebook-dir=notebooks --allow-root $(LAB_ARGS); \
	else \
	  exec $(VENV)/bin/jupyter lab --notebook-dir=notebooks $(LAB_ARGS); \
	fi

# Debian's chromium for the browser test (tests/test_browser.py drives JupyterLab in it through Playwright;
# never `playwright install`). Installed with apt-get when missing; where apt-get cannot run (no root, no
# sudo, not Debian) it says so, and the browser test skips there (it fails under CI instead).
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
	  echo "[make] no /usr/bin/chromium and no apt-get: the browser test will not run here"; \
	elif [ "$$(id -u)" = 0 ]; then \
	  echo "[make] installing Debian's chromium for the browser test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	elif command -v sudo >/dev/null 2>&1; then \
	  echo "[make] installing Debian's chromium for the browser test (sudo)"; \
	  sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
	  echo "[make] no /usr/bin/chromium, and apt-get needs root: the browser test will not run here"; \
	fi

# The venvs a learner gets, for the tests: `make lab`'s own recipe into .venv-lab, and Binder's recipe (its
# requirements.txt, then its postBuild, as repo2docker runs them) into .venv-binder. PIP_RETRIES=0: where
# Binder's extra index (PyTorch's CPU wheels) cannot be reached, pip goes on without it at once (torch then
# comes from a local wheel) instead of retrying every package five times.
LAB_VENV := .venv-lab
BINDER_VENV := .venv-binder

$(BINDER_VENV)/.binder: binder/requirements.txt binder/postBuild pyproject.toml
	rm -rf $(BINDER_VENV)
	$(PYTHON) -m venv $(BINDER_VENV)
	set -o pipefail; PIP_RETRIES=0 $(BINDER_VENV)/bin/python -m pip --disable-pip-version-check install -q \
	  -r binder/requirements.txt 2>&1 | { grep -v -e "is ignored" -e "Retrying" || true; }
	set -o pipefail; PATH="$(abspath $(BINDER_VENV))/bin:$$PATH" bash binder/postBuild 2>&1 \
	  | { grep -v "is ignored" || true; }
	@$(BINDER_VENV)/bin/python -c "import treeattn_lab, jupyterlab, plotly, ipywidgets, anywidget" && touch $@

bare-venvs: $(BINDER_VENV)/.binder
	@$(MAKE) --no-print-directory VENV=$(LAB_VENV) $(LAB_VENV)/.lab

test: $(VENV)/.dev browser bare-venvs
	$(VENV)/bin/ruff check .
	TREEATTN_LAB_PYTHON="$(abspath $(LAB_VENV))/bin/python" TREEATTN_BINDER_PYTHON="$(abspath $(BINDER_VENV))/bin/python" \
	  $(PY) -m pytest -n 2 --dist loadgroup -q $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .

bench-tree: $(VENV)/.lab
	$(PY) -m treeattn_lab bench tree

clean:
	rm -rf $(VENV) $(LAB_VENV) $(BINDER_VENV) build dist *.egg-info
