# One-command entry points. Each creates .venv on first use and installs what
# it needs; later runs reuse it (pip is a no-op when nothing changed).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
WORKDIR ?= workdirs/sao_tiny
# Simulated devices for the CPU runs and tests (the same code shards on pods).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: train test bench clean

$(VENV)/.installed-%: setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$*]'
	@touch $@

# The main job on its CPU default.
train: $(VENV)/.installed-test,parity
	$(PY) launch/kernels_demo.py

# The test suite (what .ci/run calls).
test: $(VENV)/.installed-test,parity
	$(PY) -m pytest -n 2 -q tests

bench: $(VENV)/.installed-test,parity
	$(PY) benchmarks/gae.py && $(PY) benchmarks/model.py

clean:
	rm -rf $(VENV) *.egg-info
