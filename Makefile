# laps: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "laps needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $@

demo: install
	$(BIN)/laps demo --duration 60

test: install
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
