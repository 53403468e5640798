# Two entry points for a fresh machine (both idempotent):
#   make repro   set up .venv and run the pipeline on the offline default preset
#   make test    set up .venv and run the test suite
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Stage commands call `python3`: make it the project's interpreter.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup repro test

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	# torch first and pinned, so that no resolver step can reach for a CUDA build.
	$(VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VENV)/bin/python -m pip install --quiet -e '.[dev,hf,eval]'
	touch $(STAMP)

setup: $(STAMP)

repro: $(STAMP)
	$(VENV)/bin/dvc repro

test: $(STAMP)
	@# CI (CI=true) also gets Debian's Chromium for the browser test, where apt can install it;
	@# elsewhere that test skips with a reason when /usr/bin/chromium is absent.
	@if [ "$$CI" = "true" ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "note: chromium could not be installed; the browser test will skip"; \
	fi
	$(VENV)/bin/python -m pytest -q
