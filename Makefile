# Fresh-machine entry points. `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints.txt
CORPUS ?= corpus/minilm-fp32-lr1e-6

.PHONY: venv venv-bench test demo bench corpora clean

$(VENV)/.dev: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -e '.[dev]'
	touch $@

$(VENV)/.bench: $(VENV)/.dev
	$(PIP) -e '.[dev,bench]'
	touch $@

venv: $(VENV)/.dev
venv-bench: $(VENV)/.bench

test: venv
	$(PY) -m pytest -q

# The main job: build a real-model corpus (three RL regimes) and print the codec bench table.
demo: venv-bench
	$(PY) scripts/make_corpus.py --regime fp32-lr1e-6 --steps 4 --out corpus/minilm-fp32-lr1e-6 --overwrite
	$(PY) -m relay.cli bench corpus/minilm-fp32-lr1e-6 --chart out/bench-fp32-lr1e-6.png

corpora: venv-bench
	$(PY) scripts/make_corpus.py --regime fp32-lr1e-6 --steps 6 --out corpus/minilm-fp32-lr1e-6 --overwrite
	$(PY) scripts/make_corpus.py --regime fp32-lr5e-6-wd --steps 6 --out corpus/minilm-fp32-lr5e-6-wd --overwrite
	$(PY) scripts/make_corpus.py --regime bf16-lr3e-6 --steps 6 --out corpus/minilm-bf16-lr3e-6 --overwrite

bench: corpora
	$(PY) -m relay.cli bench corpus/minilm-fp32-lr1e-6 corpus/minilm-fp32-lr5e-6-wd corpus/minilm-bf16-lr3e-6 --chart out/bench.png

clean:
	rm -rf $(VENV) corpus out

# Static checks of infra/: checkov lives in its own venv so its pins never meet the project's.
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV    := .venv-checkov

$(CHECKOV_VENV)/.checkov-$(CHECKOV_VERSION):
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q --upgrade pip
	$(CHECKOV_VENV)/bin/python -m pip install -q checkov==$(CHECKOV_VERSION)
	touch $@

.PHONY: infra-check
infra-check: $(CHECKOV_VENV)/.checkov-$(CHECKOV_VERSION)
	CHECKOV=$(CHECKOV_VENV)/bin/checkov PYTHON=$(PYTHON) scripts/infra_check.sh
