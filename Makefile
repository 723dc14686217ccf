# make book: build the book into _build/html.  make test: every check.
# Both create .venv and install requirements.txt and flashlab first.

PYTHON ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin
STAMP := $(VENV)/.installed
# MathJax served with the book, so math renders with no network.
MATHJAX := _mathjax/mathjax/tex-chtml.js
# Notebook kernels and tools must come from the venv, not the system.
export PATH := $(BIN):$(PATH)

.PHONY: book test lint unit notebooks browser execute dist clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $@

$(MATHJAX):
	npm install --no-save --no-audit --no-fund --prefix .mathjax \
	    mathjax@3.2.2
	rm -rf _mathjax
	mkdir -p _mathjax
	cp -r .mathjax/node_modules/mathjax/es5 _mathjax/mathjax

# The book shows the chapters' committed outputs and executes nothing
# (_config.yml): `make notebooks` re-runs each chapter and compares it with
# them, `make execute` stores new ones. check_book.py refuses a chapter
# with a cell never run or an error stored.
book: $(STAMP) $(MATHJAX)
	rm -rf _build
	$(BIN)/jupyter-book build . --all -W -n --keep-going
	$(BIN)/python tests/check_book.py _build/html
	@echo "Open $(CURDIR)/_build/html/intro.html"

lint: $(STAMP)
	$(BIN)/ruff check .

unit: $(STAMP)
	$(BIN)/python -m pytest tests

# -p no:cacheprovider: beside `make unit`, two runs must not share a cache
notebooks: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider --nbval --nbval-current-env \
	    --nbval-sanitize-with tests/nbval_sanitize.cfg notebooks

# Debian's Chromium for the browser test (Playwright never downloads one).
/usr/bin/chromium:
	apt-get update -q && apt-get install -y -q chromium

browser: $(STAMP) /usr/bin/chromium
	$(BIN)/python -m pytest -m browser tests/test_browser.py

# Every check, in this order: lint; the unit tests and nbval side by side
# (each is mostly one busy core, so on two cores they take little more
# than the longer one alone); then the book from the outputs nbval has just
# compared, and the browser test of that book.
test: lint
	$(MAKE) --jobs=2 --output-sync=target unit notebooks
	$(MAKE) book
	$(MAKE) browser

# Re-run every chapter and store its outputs (after changing flashlab).
execute: $(STAMP)
	$(BIN)/jupyter execute --inplace --timeout=600 notebooks/*.ipynb

# The wheel and sdist of flashlab-course (import name flashlab) in dist/.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/twine check --strict dist/*

clean:
	rm -rf _build dist $(VENV)
