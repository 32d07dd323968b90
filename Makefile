# domainpar developer entry points: `make test`, `make demo`, `make setup`.
#
# Every target sets up what it needs by itself and is idempotent. Finished
# setup steps leave stamp files in .venv/.stamps, so a rerun on a machine that
# is already set up costs well under a second before the real work; deleting
# .venv (or `make distclean`) starts over. The parallel h5py wheel, the one
# slow step, is cached outside the clone (H5PY_WHEEL_CACHE) and reused by
# every later clone or venv on this machine.
#
# Knobs (make VAR=value or environment):
#   PYTHON=python3           interpreter that creates .venv
#   NP_LIST="1 2 3 4"        MPI sizes the test stages run with
#   PYTEST_ARGS=...          extra pytest args for every stage (e.g. -x, -k halo)
#   TEST_TIMEOUT=120         per-test timeout in seconds
#   TEST_TOTAL_TIMEOUT=1800  last-resort limit for one MPI stage, in seconds
#   FAIL_FAST=1              stop `make test` after the first failing stage
#   LARGE_NP=8               ranks of `make test`'s larger-grid stage (mpi-n<LARGE_NP>)
#   HDF5_DIR=...             parallel HDF5 prefix to build h5py against
#   MPIEXEC=mpiexec          launcher for the demo and the MPI test stages
#   DEMO_NP=2                ranks `make demo` runs on
#   DEMO_ARGS=...            extra `domainpar demo` options (e.g. --steps 100
#                            --memory-per-rank 1GiB --side 80; docs/demo.md)
#   ALLOW_CUDA_TORCH=1       permit a torch install that pulls CUDA wheels

# One bash per recipe with strict error handling: recipes read like scripts
# and any failing command fails the target.
SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.ONESHELL:
.DELETE_ON_ERROR:
MAKEFLAGS += --no-builtin-rules
.DEFAULT_GOAL := help

# Taken when make starts, so `make test` can report its own setup overhead.
T0_MS := $(shell date +%s%3N)

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := $(VENV)/.stamps
# Every pip install goes through the constraints: that is what keeps torch at
# the local CPU build and the whole environment reproducible.
PIP_INSTALL := $(PY) -m pip install -c constraints.txt

# slurm-wlm and munge: tests/test_slurm.py starts a one-node Slurm and submits
# the slurm/ templates to it.
APT_PACKAGES := openmpi-bin libopenmpi-dev gfortran libhdf5-openmpi-dev cmake slurm-wlm munge
# Keep in sync with the `test` extra in pyproject.toml. Installed explicitly
# because the package itself is installed with --no-deps (see the pkg stamp).
TEST_REQUIREMENTS := pytest pytest-mpi pytest-timeout hypothesis opt-einsum tensorly einops \
	monai requests expecttest ruff mypy
# Test requirements installed with --no-deps, after the others: neuraloperator's
# declared dependencies pull wandb (with some 30 packages), zencfg and configmypy,
# which its models never import; what they do import is in TEST_REQUIREMENTS.
NODEPS_TEST_REQUIREMENTS := neuraloperator tensorly-torch
# The `plots` extra in pyproject.toml: PNGs from `domainpar bench` and the demo.
PLOT_REQUIREMENTS := matplotlib
# The `docs` extra in pyproject.toml: the Sphinx site (`make docs`, docs/conf.py),
# pure-Python wheels; installed by setup so that `make test` can build it.
DOCS_REQUIREMENTS := sphinx myst-parser numpydoc furo

H5PY_VERSION := $(shell sed -n 's/^h5py==\([^ #]*\).*/\1/p' constraints.txt)
H5PY_WHEEL_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/domainpar/wheels
# Debian's parallel HDF5 prefix (has include/ and lib/), looked up only when
# h5py is built, i.e. after the apt step has run.
HDF5_DIR ?= $(shell dpkg -L libhdf5-openmpi-dev 2>/dev/null | grep -m1 -E '^/usr/lib/[^/]+/hdf5/openmpi$$')
MPICC ?= mpicc
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
ALLOW_CUDA_TORCH ?= 0

MPIEXEC ?= mpiexec
DEMO_NP ?= 2
DEMO_ARGS ?=
NP_LIST ?= 1 2 3 4
PYTEST_ARGS ?=
TEST_TIMEOUT ?= 120
TEST_TOTAL_TIMEOUT ?= 1800
FAIL_FAST ?=
# Test and demo processes: one OpenMP thread per rank, since the MPI stages
# oversubscribe the cores (the caller's own setting wins).
export OMP_NUM_THREADS ?= 1
export DOMAINPAR_TEST_TIMEOUT := $(TEST_TIMEOUT)
export DOMAINPAR_TEST_TOTAL_TIMEOUT := $(TEST_TOTAL_TIMEOUT)
export MPIEXEC
# For the demo's and the coupling examples' mpiexec. The launch environment is
# defined once, in domainpar/launch.py (LAUNCH_ENV), which domainpar's commands
# and tests/run_mpi.py use; every VAR=value here must match it
# (tests/test_layers.py checks).
MPI_RUN_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	OMPI_MCA_rmaps_base_oversubscribe=1

# The larger-grid stages (issue 20): a chosen subset of the MPI suite on 8 ranks
# in `make test` (mpi-n8) and on 16 in `make test-large`, oversubscribed, small
# sizes. The tests take their grids from the world size: at 8 ranks 2x2x2 (4x2x2
# at 16). Selected: halo fill/accumulate on 3- and 4-D grids (random periodic
# axes, uneven and empty blocks, widths past the neighbour's block) and the
# periodic wrap; every repartition test (random layouts between grids, adjoint);
# conv on 3-D grids; the 3-D pooling modules; norm modules and interpolate on
# 3-D grids; ring attention (SDPA cases and RingShift: rings of 8 and 16 blocks,
# causal, uneven, empty); FFT on 2-D grids; DomainParallel gradient buckets and
# training on a batch x 2x2 grid; from tests/test_large_grids.py also halo
# fill/accumulate on the explicit grids 2x2x2 (8 ranks), 2x2x4 and 4x4x1 (16),
# periodic and uneven axes, two-hop widths; FFTs over three sharded dims;
# repartitions onto dims cut over several axes; a checkpoint and an HDF5
# field written on a 3-D grid, restarted and read on 3 ranks.
LARGE_NP ?= 8
LARGE_TESTS := tests/test_halo.py tests/test_collectives.py tests/test_conv.py \
	tests/test_pool.py tests/test_norm.py tests/test_resample.py tests/test_attention.py \
	tests/test_fft.py tests/test_domain_parallel.py tests/test_large_grids.py
LARGE_K := ((fill_equals or accumulate_is) and (-3- or -4-)) or outer_ghosts_untouched \
	or repartition or (conv_matches and (-3-even- or -3-uneven- or -3-zero-)) \
	or modules_on_3d_grid or (module_matches_one_process and -3d-) \
	or (interpolate_matches and grid3) or sdpa_matches or ring_shift_adjoint \
	or (transform_matches and -2d) or domain_parallel_gradients_match or batch_by_2x2 \
	or explicit_3d_grids or three_sharded_dims or layouts_of_a_3d_grid or restart_on_3_ranks
# The per-test timeout is TEST_TIMEOUT's: no selected test took over 1.5 s at
# 8 or 16 ranks on 2 cores.
LARGE_RUN = $(PY) tests/run_mpi.py -n $(1) -q $(LARGE_TESTS) -k "$(LARGE_K)"
# The network path (issue 20): 2 ranks over Open MPI's TCP transport alone on the
# loopback interface, shared memory off (tests/run_mpi.py --transport tcp;
# domainpar/launch.py, TRANSPORTS). Halo fill/accumulate, collectives and
# repartition, DomainParallel's gradient buckets and training, ring attention.
TCP_TESTS := tests/test_halo.py tests/test_collectives.py tests/test_domain_parallel.py \
	tests/test_attention.py
TCP_K := fill_equals or accumulate_is or allreduce or allgatherv_equals \
	or repartition_named or repartition_adjoint or domain_parallel_gradients_match \
	or training_matches or ring_shift_adjoint or sdpa_matches

.PHONY: help setup sysdeps kernels test test-large demo docs coupling clean distclean FORCE

help:
	@echo "make demo       set up, then the main job on $(DEMO_NP) ranks: a field one process cannot hold (576 MiB per rank) trains sharded; check, plot"
	echo "make test       set up, then lint (ruff), types (mypy), serial tests, MPI tests on $(NP_LIST) ranks, a subset on $(LARGE_NP) ranks and one on 2 ranks over TCP"
	echo "make test-large a subset of the MPI tests on 16 ranks (larger grids; not in make test)"
	echo "make setup      only the setup: apt packages, .venv, parallel h5py, package, kernels"
	echo "make kernels    (re)build the native kernels with CMake when their sources changed"
	echo "make docs       the documentation site (Sphinx, warnings are errors) into build/docs"
	echo "make coupling   build the C/Fortran coupling examples and run each on 4 ranks"
	echo "make clean      remove build/ and domainpar/_native/ (keeps .venv)"
	echo "make distclean  also remove .venv (the h5py wheel cache in $(H5PY_WHEEL_CACHE) stays)"

setup: sysdeps $(STAMPS)/pkg $(STAMPS)/docs kernels

# Checked on every run instead of stamped: dpkg-query takes milliseconds and
# notices packages removed since. apt only runs when something is missing.
sysdeps:
	@if ! command -v dpkg-query >/dev/null; then
		echo "sysdeps: no dpkg here; skipping apt. Provide MPI, parallel HDF5 (set HDF5_DIR), cmake, gfortran yourself."
		exit 0
	fi
	missing=
	for p in $(APT_PACKAGES); do
		dpkg-query -W -f='$${Status}\n' "$$p" 2>/dev/null | grep -q ' installed$$' || missing="$$missing $$p"
	done
	[ -z "$$missing" ] && exit 0
	echo "==> apt-get install$$missing"
	sudo=; [ "$$(id -u)" -eq 0 ] || sudo=sudo
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q
	$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing

# Order-only on sysdeps: apt must have run first, but a phony prerequisite
# must not make the stamps look stale on every run.
$(STAMPS)/venv: | sysdeps
	@if [ ! -x $(PY) ]; then
		echo "==> creating $(VENV) with $(PYTHON)"
		$(PYTHON) -m venv $(VENV)
	fi
	mkdir -p $(STAMPS)
	touch $@

# torch, numpy, the mpi4py binary wheel and the tools the h5py build needs.
# mpi4py is never compiled here: its wheel finds the system Open MPI at run time.
$(STAMPS)/base: constraints.txt $(STAMPS)/venv
	@echo "==> installing torch, numpy, mpi4py and build tools into $(VENV)"
	if [ "$(ALLOW_CUDA_TORCH)" != 1 ]; then
		# Resolve first without installing: if torch would come from PyPI with
		# its CUDA wheels (gigabytes), stop before downloading anything big.
		$(PIP_INSTALL) --dry-run --quiet --report $(STAMPS)/torch-plan.json torch
		$(PY) -c 'import json, sys; \
			names = [i["metadata"]["name"] for i in json.load(open(sys.argv[1]))["install"]]; \
			bad = [n for n in names if n.lower().startswith(("nvidia-", "triton"))]; \
			bad and sys.exit("refusing to install a CUDA build of torch (it would pull " + ", ".join(bad) \
			+ "). Put the torch +cpu wheel on pip find-links, or set ALLOW_CUDA_TORCH=1.")' \
			$(STAMPS)/torch-plan.json
	fi
	$(PIP_INSTALL) --only-binary mpi4py torch numpy mpi4py setuptools cython pkgconfig packaging
	$(PY) -c 'from mpi4py import MPI; print("mpi4py uses", MPI.Get_library_version().splitlines()[0].strip())'
	touch $@

# h5py against parallel HDF5, built once per machine and cached as a wheel.
# --no-build-isolation: an isolated build would compile mpi4py from source
# (20+ minutes, ~20 GB of memory); the venv already has everything it needs.
# The cache key covers what the binary depends on: HDF5 build and location,
# mpi4py version; the Python tag is part of the wheel's file name.
$(STAMPS)/h5py: constraints.txt $(STAMPS)/base
	@hdf5_dir='$(HDF5_DIR)'
	if [ -z "$$hdf5_dir" ] || [ ! -d "$$hdf5_dir" ]; then
		echo "h5py: no parallel HDF5 found; set HDF5_DIR to its prefix (with include/ and lib/)" >&2
		exit 1
	fi
	hdf5_ver=$$(dpkg-query -W -f='$${Version}' libhdf5-openmpi-dev 2>/dev/null || echo custom)
	mpi4py_ver=$$($(PY) -c 'import mpi4py; print(mpi4py.__version__)')
	pytag=$$($(PY) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
	key=hdf5-$${hdf5_ver//[^A-Za-z0-9.]/_}_mpi4py-$${mpi4py_ver}_$$(printf %s "$$hdf5_dir" | md5sum | cut -c1-8)
	dir=$(H5PY_WHEEL_CACHE)/$$key
	whl=$$(ls "$$dir"/h5py-$(H5PY_VERSION)-$$pytag-*.whl 2>/dev/null | head -n1 || true)
	if [ -z "$$whl" ]; then
		echo "==> building h5py $(H5PY_VERSION) against parallel HDF5 in $$hdf5_dir (a few minutes, once per machine)"
		tmp=$$(mktemp -d)
		# --no-cache-dir: pip would otherwise reuse any h5py wheel it built
		# earlier from the same sdist, whatever HDF5 it was built against.
		env CC=$(MPICC) HDF5_MPI=ON HDF5_DIR="$$hdf5_dir" \
			$(PY) -m pip wheel -c constraints.txt --no-cache-dir --no-build-isolation \
			--no-binary h5py --no-deps -w "$$tmp" h5py==$(H5PY_VERSION)
		mkdir -p "$$dir"
		# Move into place last, so an interrupted build never leaves a wheel
		# that a later setup would trust.
		mv "$$tmp"/h5py-*.whl "$$dir"/
		rm -rf "$$tmp"
		whl=$$(ls "$$dir"/h5py-$(H5PY_VERSION)-$$pytag-*.whl | head -n1)
	else
		echo "==> installing cached parallel h5py wheel $$whl"
	fi
	# --force-reinstall: a serial h5py of the same version may already be there.
	$(PIP_INSTALL) --force-reinstall --no-deps "$$whl"
	$(PY) -c 'import h5py; assert h5py.get_config().mpi, "h5py was built without MPI"'
	touch $@

# The package itself, editable and without dependency resolution, so that pip
# never tries to resolve torch on its own. Reinstalled when the metadata
# changes or once domainpar/__init__.py first appears.
$(STAMPS)/pkg: pyproject.toml setup.py $(wildcard domainpar/__init__.py) $(STAMPS)/h5py
	@echo "==> installing domainpar (editable) and the test tools"
	$(PIP_INSTALL) --no-build-isolation --no-deps -e .
	$(PIP_INSTALL) $(TEST_REQUIREMENTS) $(PLOT_REQUIREMENTS)
	$(PIP_INSTALL) --no-deps $(NODEPS_TEST_REQUIREMENTS)
	touch $@

# The docs tools, stamped apart so that an existing setup gets them too.
$(STAMPS)/docs: $(STAMPS)/pkg
	@echo "==> installing the docs tools"
	$(PIP_INSTALL) $(DOCS_REQUIREMENTS)
	touch $@

# Native kernels. The stamp lives in build/ next to what it stands for, so
# deleting build/ rebuilds. cmake's own incremental build does the fine work;
# the stamp only saves starting cmake when no source changed.
ifneq ($(wildcard CMakeLists.txt),)
kernels: build/.stamp-kernels

# Also rebuild when the libraries in domainpar/_native/ were deleted by hand.
build/.stamp-kernels: CMakeLists.txt $(wildcard kernels/* kernels/*/*) \
		$(if $(wildcard domainpar/_native/*),,FORCE) | $(STAMPS)/pkg
	@echo "==> building native kernels"
	# Point CMake at the venv's Python in case the project looks one up.
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release --no-warn-unused-cli \
		-DPython_EXECUTABLE=$(abspath $(PY)) -DPython3_EXECUTABLE=$(abspath $(PY))
	cmake --build build -j$(JOBS)
	touch $@
else
kernels:
	@echo "kernels: no CMakeLists.txt yet; skipping the native build"
endif

FORCE:

# Lint (ruff), types (mypy), serial tests, then the MPI tests once per size in NP_LIST. All stages run
# (unless FAIL_FAST=1) so one CI log shows every failure; each stage's console
# output is also kept in build/test-logs/<stage>.out, and the logs of ranks
# 1..N-1 in build/test-logs/n<N>/ (see tests/run_mpi.py).
# Exit code 5 (nothing collected) is fine for a single stage, e.g. no test
# needs MPI yet, but a run in which no stage collected anything fails.
# The serial stage uses pytest-timeout's default signal method, which fails
# just the hung test and carries on; the MPI stages need the thread method.
test: setup
	@set +e
	t_setup=$$(( $$(date +%s%3N) - $(T0_MS) ))
	[ -t 1 ] && color=yes || color=no
	logs=build/test-logs
	mkdir -p $$logs
	summary=()
	failed=0
	empty=0
	total=0
	stage() {
		local name=$$1; shift
		echo; echo "=== $$name: $$*"
		local t=$$(date +%s%3N)
		"$$@" 2>&1 | tee $$logs/$$name.out
		local rc=$$?
		local ms=$$(( $$(date +%s%3N) - t ))
		local status=ok
		total=$$((total + 1))
		if [ $$rc -eq 5 ]; then status="no tests"; empty=$$((empty + 1))
		elif [ $$rc -ne 0 ]; then status="FAILED($$rc)"; failed=1; fi
		summary+=("$$(printf '%-8s %-10s %5d.%ds  %s' "$$name" "$$status" $$((ms / 1000)) $$((ms % 1000 / 100)) "$$(tail -n1 $$logs/$$name.out)")")
		[ $$rc -eq 0 ] || [ $$rc -eq 5 ] || [ -z "$(FAIL_FAST)" ]
	}
	# ruff's rules and their reasons: [tool.ruff] in pyproject.toml.
	stage lint $(PY) -m ruff check --no-cache .
	# mypy: strict on comm/, autograd/, tensor/, the rest checked; settings and
	# their reasons in [tool.mypy] of pyproject.toml (its cache: build/mypy-cache).
	if [ $$failed -eq 0 ] || [ -z "$(FAIL_FAST)" ]; then
		stage types $(PY) -m mypy
	fi
	if [ $$failed -eq 0 ] || [ -z "$(FAIL_FAST)" ]; then
		stage serial $(PY) -m pytest -q -p no:cacheprovider --color=$$color -m "not mpi" \
			--timeout=$(TEST_TIMEOUT) $(PYTEST_ARGS) tests
	fi
	if [ $$failed -eq 0 ] || [ -z "$(FAIL_FAST)" ]; then
		stage docs $(SPHINX)
	fi
	if [ $$failed -eq 0 ] || [ -z "$(FAIL_FAST)" ]; then
		for n in $(NP_LIST); do
			stage mpi-n$$n $(PY) tests/run_mpi.py -n $$n -q --color=$$color $(PYTEST_ARGS) || break
		done
	fi
	if [ $$failed -eq 0 ] || [ -z "$(FAIL_FAST)" ]; then
		stage mpi-n$(LARGE_NP) $(call LARGE_RUN,$(LARGE_NP)) --color=$$color $(PYTEST_ARGS)
	fi
	if [ $$failed -eq 0 ] || [ -z "$(FAIL_FAST)" ]; then
		stage mpi-tcp $(PY) tests/run_mpi.py -n 2 --transport tcp -q --color=$$color \
			$(TCP_TESTS) -k "$(TCP_K)" $(PYTEST_ARGS)
	fi
	if [ $$total -gt 0 ] && [ $$empty -eq $$total ]; then
		summary+=("no stage collected any test: is tests/ empty?"); failed=1
	fi
	t_all=$$(( $$(date +%s%3N) - $(T0_MS) ))
	echo; echo "=== summary"
	printf '%s\n' "$${summary[@]}"
	printf 'make test: %s in %d.%ds (setup %d.%ds)\n' "$$( [ $$failed -eq 0 ] && echo PASSED || echo FAILED)" \
		$$((t_all / 1000)) $$((t_all % 1000 / 100)) $$((t_setup / 1000)) $$((t_setup % 1000 / 100))
	exit $$failed

# The larger-grid subset (LARGE_TESTS, LARGE_K) on 16 ranks, oversubscribed.
test-large: setup
	@$(call LARGE_RUN,16) $(PYTEST_ARGS)

# The main job (`domainpar demo --help`, docs/demo.md): the plan for a field one
# process cannot hold under a 576 MiB per-rank budget (RLIMIT_DATA in each
# rank), Gray-Scott solved domain-parallel, written to HDF5, the one-process
# training step running out of the budget, a 3-D UNet surrogate trained sharded
# under it, checked against one process, PNGs in demo-out/. About 5 minutes on
# 2 idle cores; the timeout is a last resort.
demo: setup
	@set -x
	env $(MPI_RUN_ENV) timeout -k 10 1800 $(MPIEXEC) -n $(DEMO_NP) \
		$(abspath $(VENV))/bin/domainpar demo -n $(DEMO_NP) $(DEMO_ARGS)

# The documentation site (docs/conf.py): Markdown pages, the design map, the
# API reference from docstrings, the generated op table. Warnings are errors;
# -E rebuilds from scratch (a few seconds), so a stale page cannot hide one.
SPHINX = $(PY) -m sphinx -W --keep-going -E -b html docs build/docs
docs: setup
	@$(SPHINX)
	echo "docs: build/docs/index.html"

# The coupling examples: C and Fortran simulations training a domainpar model
# online (examples/coupling/README.md). CMake builds them with the kernels; the
# explicit build catches edits to examples/coupling/, which the stamp ignores.
coupling: setup
	@cmake --build build -j$(JOBS) --target heat2d_c heat2d_f
	for exe in heat2d_c heat2d_f; do
		echo "==> mpiexec -n 4 build/examples/coupling/$$exe"
		env $(MPI_RUN_ENV) timeout -k 10 600 $(MPIEXEC) -n 4 build/examples/coupling/$$exe
	done

clean:
	@rm -rf build domainpar/_native

distclean: clean
	@rm -rf $(VENV)
