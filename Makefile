# laps: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test sglang-env clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "laps needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

demo: install
	$(BIN)/laps demo --duration 60

# The real-SGLang tests' environment (~10 GB, cached under ~/.cache/laps): built here, outside
# pytest's output capture, so that a first run shows what it is doing.
sglang-env: install
	$(BIN)/python -m tests.sglang_env

test: install sglang-env
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
