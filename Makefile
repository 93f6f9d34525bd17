# Every target sets up what it needs and is safe to repeat. See README.rst.
PYTHON ?= python3.11
VENV := .venv
PY := $(CURDIR)/$(VENV)/bin/python
CONSTRAINTS := continuous_integration/constraints-py3.11.txt
REQUIREMENTS := continuous_integration/requirements-test.txt
PIP_INSTALL = -m pip install --quiet --disable-pip-version-check -c $(CURDIR)/$(CONSTRAINTS)
FORK := $(PYTHON) tools/fork.py
TREE_STAMP := build/.tree-stamp
TREE_INPUTS := $(shell find patches distributed tools/forktools conftest.py pyproject.toml \
	-type f -not -path '*/__pycache__/*' 2>/dev/null)
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: tree refresh install test demo lint bench bench-quick bench-instructions clean

tree:
	$(FORK) tree
	touch $(TREE_STAMP)

$(TREE_STAMP): $(TREE_INPUTS)
	$(FORK) tree
	touch $@

refresh:
	$(FORK) refresh

# The fork, editable (edits in build/tree take effect at once), plus the test and
# lint tools, all under the constraints. compat mode puts build/tree on sys.path.
$(VENV)/.installed: $(CONSTRAINTS) $(REQUIREMENTS) | $(TREE_STAMP)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) $(PIP_INSTALL) -r $(REQUIREMENTS)
	$(PY) $(PIP_INSTALL) --no-build-isolation --config-settings editable_mode=compat -e build/tree
	touch $@

install: $(VENV)/.installed $(TREE_STAMP)

TREE_TESTS = $(shell cd build/tree && find distributed -type d -name tests -not -path '*/__pycache__*' | sort)

test: install
	cd build/tree && $(PY) -m pytest $(TREE_TESTS) $(PYTEST_ARGS)
	$(PY) -m pytest tools/tests benchmarks/tests $(PYTEST_ARGS)

demo: install
	$(PY) -m distributed.diagnostics.fine_metrics

# pre-commit with local hooks (the tools are pinned in the constraints). The
# overlay and the files the series patches are checked inside build/tree,
# under upstream's own setup.cfg; the tooling here, under ours.
PATCHED = $(shell cd build/tree && git diff --name-only --diff-filter=AM upstream HEAD -- '*.py')
lint: install
	cd build/tree && PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pre_commit run \
		--config $(CURDIR)/.pre-commit-config.yaml --files $(PATCHED)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pre_commit run \
		--files $$(find tools benchmarks -name '*.py' -not -path '*/__pycache__/*')

# Two environments under build/bench/: the fork (a regular install of
# build/tree) and pristine distributed 2023.3.1 from the package index.
BENCH_FORK := build/bench/fork
BENCH_PRISTINE := build/bench/pristine
$(BENCH_FORK)/.installed: $(CONSTRAINTS) $(TREE_STAMP)
	rm -rf $(BENCH_FORK)
	$(PYTHON) -m venv $(BENCH_FORK)
	$(BENCH_FORK)/bin/python $(PIP_INSTALL) setuptools wheel psutil lz4 numpy
	$(BENCH_FORK)/bin/python $(PIP_INSTALL) --no-build-isolation ./build/tree
	touch $@

$(BENCH_PRISTINE)/.installed: $(CONSTRAINTS)
	rm -rf $(BENCH_PRISTINE)
	$(PYTHON) -m venv $(BENCH_PRISTINE)
	$(BENCH_PRISTINE)/bin/python $(PIP_INSTALL) psutil lz4 numpy distributed==2023.3.1
	touch $@

bench: $(BENCH_FORK)/.installed $(BENCH_PRISTINE)/.installed
	$(PYTHON) benchmarks/run.py --fork $(BENCH_FORK)/bin/python \
		--pristine $(BENCH_PRISTINE)/bin/python --out build/bench $(BENCH_ARGS)

bench-quick:
	$(MAKE) bench BENCH_ARGS="--quick $(BENCH_ARGS)"

# Instructions per trivial task under valgrind's cachegrind (needs valgrind):
# repeatable where CPU time is not. See docs/benchmarks.rst.
bench-instructions: $(BENCH_FORK)/.installed $(BENCH_PRISTINE)/.installed
	$(PYTHON) benchmarks/instructions.py --fork $(BENCH_FORK)/bin/python \
		--pristine $(BENCH_PRISTINE)/bin/python $(BENCH_ARGS)

clean:
	rm -rf build $(VENV)
