# The two quickstart commands: `make demo` (the main job: PPO on the CPU demo recipe)
# and `make test` (the suite).
# Each installs what it needs first. torch is pinned to the CPU build before anything
# else so that no dependency can pull a CUDA torch on a CPU machine.
PYTHON ?= python
TORCH ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test test-unit test-dist test-sglang

install:
	$(PYTHON) -m pip install -q "$(TORCH)"
	$(PYTHON) -m pip install -q -e ".[test]"

demo: install
	$(PYTHON) -m megappo.cli train recipes/demo-cpu.yaml

test: install
	$(PYTHON) -m pytest -q tests
	$(MAKE) test-sglang

# The CPU SGLang lane: real SGLang 0.5.23 on CPU in its own virtualenv (built once, cached;
# tests/sglang/setup_venv.sh), so SGLang's pins never touch the main environment.
test-sglang:
	venv="$$(PYTHON=$(PYTHON) bash tests/sglang/setup_venv.sh)" && \
	PYTHONPATH=$(CURDIR) "$$venv/bin/python" -m pytest -q -p no:cacheprovider tests/sglang

test-unit:
	$(PYTHON) -m pytest -q tests/unit

test-dist:
	$(PYTHON) -m pytest -q tests/distributed
