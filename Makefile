# The two quickstart commands: `make demo` (the main job: PPO on the CPU demo recipe)
# and `make test` (the suite). Each installs what it needs first through tools/install.py:
# a CPU torch build on a CPU machine (PyTorch's CPU wheel index, else the plain pin), a
# CUDA build where nvidia-smi exists, an installed torch of the right build kept as it is,
# then megappo under a constraints file holding that torch and every other package at the version
# the suite last passed with (TESTED). A stamp in .make/ makes a rerun skip pip entirely;
# `rm -rf .make` forces a reinstall. docs/install.md explains it. `make test-latest` (not in CI)
# runs the unit tests against the newest releases in a virtualenv of its own and says what drifted.
PYTHON ?= python
TORCH ?= torch==2.13.0
# auto: cuda when nvidia-smi is on PATH, else cpu; or cpu / cuda
MEGAPPO_TORCH ?= auto
# the index for the CUDA build (empty: pip's default, PyPI's Linux wheel is the CUDA build)
TORCH_CUDA_INDEX ?=
STAMP_DIR ?= .make
# the versions the suite last passed with (tools/tested_set.py freeze); empty: setup.py's ranges
TESTED ?= constraints-tested.txt
export OMP_NUM_THREADS ?= 1

INSTALL = $(PYTHON) tools/install.py --python "$(PYTHON)" --torch "$(TORCH)" --flavour $(MEGAPPO_TORCH) \
	--cuda-index "$(TORCH_CUDA_INDEX)" --stamp-dir "$(STAMP_DIR)" --tested "$(TESTED)"

.PHONY: install install-test demo test test-unit test-dist test-sglang test-latest gpu-check

install:
	$(INSTALL)

install-test:
	$(INSTALL) --extras test

demo: install
	$(PYTHON) -m megappo.cli train recipes/demo-cpu.yaml

# `make test` ends with the CPU SGLang lane; SGLANG_LANE= (empty) leaves it out
SGLANG_LANE ?= test-sglang
# compileall: the suite starts a few hundred Python processes; where the environment sets
# PYTHONDONTWRITEBYTECODE (this project's machines do), each would compile megappo again (~0.5 s a process)
# tools/system_packages.py: the Debian packages the SLURM tests need (apt-get, root; instant when installed)
# Three pytest runs (tests/conftest.py says which test is in which): the tests marked one_process (tests/unit,
# and e2e tests that start one process of one rank and time nothing) on TEST_WORKERS processes (pytest-xdist;
# auto: one per core); the other multi-process tests MULTI_WORKERS files at a time (their ranks share the cores
# and wait on each other often enough that two files at once finish sooner than one); then those marked alone
# (they time things or give ranks deadlines of seconds) one at a time. Each runs whatever the others say.
TEST_WORKERS ?= auto
MULTI_WORKERS ?= 2
test: install-test
	$(PYTHON) tools/system_packages.py
	$(PYTHON) -m compileall -q megappo tests tools benchmarks > /dev/null
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m one_process --durations=25 tests/unit tests/e2e; \
	one_process=$$?; \
	$(PYTHON) -m pytest -q -n $(MULTI_WORKERS) --dist loadfile -m "not one_process and not alone" --durations=25 \
		--ignore=tests/unit tests; multi=$$?; \
	$(PYTHON) -m pytest -q -m alone --durations=25 --ignore=tests/unit tests && exit $$(( one_process || multi ))
ifneq ($(SGLANG_LANE),)
	$(MAKE) $(SGLANG_LANE)
endif

# The CPU SGLang lane: real SGLang 0.5.23 on CPU in its own virtualenv (built once, cached;
# tests/sglang/setup_venv.sh), so SGLang's pins never touch the main environment.
test-sglang:
	venv="$$(PYTHON=$(PYTHON) bash tests/sglang/setup_venv.sh)" && \
	PYTHONPATH=$(CURDIR) "$$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 tests/sglang

test-unit:
	$(PYTHON) -m pytest -q tests/unit

test-dist:
	$(PYTHON) -m pytest -q tests/distributed

# The unit tests against the newest releases setup.py's ranges allow (torch at TORCH), in a
# virtualenv of its own ($(STAMP_DIR)/latest, reused), then the packages that differ from TESTED.
# Not part of CI; docs/install.md says how the tested set is updated from it.
test-latest:
	$(PYTHON) tools/tested_set.py latest --python "$(PYTHON)" --venv "$(STAMP_DIR)/latest" --torch "$(TORCH)" \
		--flavour $(MEGAPPO_TORCH) --cuda-index "$(TORCH_CUDA_INDEX)" --tested "$(TESTED)"

# One H100/H200 checked in one 10-minute call, no registry (benchmarks/GPU.md): GPU-marked tests,
# gpu.py's smoke, mfu, gen, sync and e2e sections; one JSON + table in $(OUT) (default ./gpu-check).
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(if $(OUT),--out $(OUT))
