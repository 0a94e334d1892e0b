# `make test` and `make demo` do all set-up on a fresh machine: venv, dependencies, Cython build.
# `make test` is the fast tier (pytest -m "not heavy"), `make test-all` every test (docs/contributing.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install build test test-all test-cython test-pure demo bench bench-scale soak clean dist cluster-demo

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip setuptools wheel cython numpy
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# Rebuild the extension in place whenever a .pyx changed (cheap when nothing did). A failed compile
# is an error here (setup.py would otherwise fall back to the twins, as a user's install does).
build: $(STAMP)
	DSTL_REQUIRE_CYTHON=1 $(PY) setup.py -q build_ext --inplace

# Both implementations, Cython first, then the twins (DSTL_PUREPYTHON=1). test-cython and test-pure
# run one of them, on the tier MARK selects (MARK= selects every test).
MARK ?= not heavy

test: build
	$(MAKE) test-cython test-pure

# Both halves at once: the twins' run, niced, fills the CPU that the Spark scenarios of the Cython run
# leave idle while they wait on JVMs, stalls and timeouts; after it, in the same background chain, the
# fast tier under pandas 2 (test-pandas2). Their output follows the Cython run's. Each run ends with its
# slowest tests: the tier's time budget (docs/contributing.md).
ALL_ARGS = MARK= PYTEST_ARGS="--durations=25 $(PYTEST_ARGS)"
test-all: build
	@mkdir -p build && rm -f build/test-pure.log build/test-pure.rc build/test-pandas2.log build/test-pandas2.rc
	@(nice -n 10 $(MAKE) --no-print-directory test-pure $(ALL_ARGS) > build/test-pure.log 2>&1; \
	  echo $$? > build/test-pure.rc; \
	  nice -n 10 $(MAKE) --no-print-directory pandas2-tier PYTEST_ARGS="--durations=10 $(PYTEST_ARGS)" \
	    > build/test-pandas2.log 2>&1; echo $$? > build/test-pandas2.rc) & \
	$(MAKE) --no-print-directory test-cython $(ALL_ARGS); c=$$?; wait; \
	echo "=== the twins' run (DSTL_PUREPYTHON=1), beside the Cython run ==="; cat build/test-pure.log; \
	echo "=== the fast tier under pandas 2 (make test-pandas2), after the twins' run ==="; cat build/test-pandas2.log; \
	test $$c -eq 0 && test "$$(cat build/test-pure.rc)" -eq 0 && test "$$(cat build/test-pandas2.rc)" -eq 0

test-cython:
	$(PY) -m pytest -q -p no:cacheprovider $(if $(MARK),-m "$(MARK)") $(PYTEST_ARGS) tests

test-pure:
	DSTL_PUREPYTHON=1 $(PY) -m pytest -q -p no:cacheprovider $(if $(MARK),-m "$(MARK)") $(PYTEST_ARGS) tests

# The fast tier, Cython build, under pandas 2 (a fresh .venv resolves the newest pandas, 3; both are
# supported). Its venv holds dstl's requirements with pandas>=2,<3, listed from .venv's
# install of this checkout (scripts/requirements.py), and the checkout itself on its path (a .pth,
# as an editable install writes): the extension `make build` compiled is the one tested, and no
# second build writes into the tree while another run uses it.
VENV_PD3 ?= .venv-pandas2
PY_PD3 := $(VENV_PD3)/bin/python
STAMP_PD3 := $(VENV_PD3)/.installed-stamp
$(STAMP_PD3): $(STAMP)
	test -x $(PY_PD3) || $(PYTHON) -m venv $(VENV_PD3)
	$(PY_PD3) -m pip install -q -U pip setuptools wheel
	@mkdir -p build
	$(PY) scripts/requirements.py test --override "pandas>=2,<3" > build/pandas2-requirements.txt
	$(PY_PD3) -m pip install -q -r build/pandas2-requirements.txt
	echo "$(CURDIR)" > "$$($(PY_PD3) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dstl-checkout.pth"
	touch $(STAMP_PD3)

.PHONY: test-pandas2 pandas2-tier
test-pandas2: build
	$(MAKE) --no-print-directory pandas2-tier

# test-all runs this one, beside the Cython run: `build` is done, and must not run again meanwhile
pandas2-tier: $(STAMP_PD3)
	$(PY_PD3) -c "import pandas, dstl; assert int(pandas.__version__.split('.')[0]) == 2, pandas.__version__; \
	  assert dstl.IMPLEMENTATION == 'cython', dstl.IMPLEMENTATION; print('pandas', pandas.__version__)"
	$(PY_PD3) -m pytest -q -p no:cacheprovider -m "not heavy" $(PYTEST_ARGS) tests

demo: build
	$(PY) -m dstl demo

# The sdist and the wheel (compiled for this Python, with this venv's Cython and NumPy). Executors
# need the wheel: `pip install "dist/pyspark_dstl-*.whl[executor,s3]"` (docs/spark.md, "A real cluster").
dist: $(STAMP)
	rm -f dist/pyspark_dstl-*
	DSTL_REQUIRE_CYTHON=1 $(PY) -m build -q --no-isolation --outdir dist .
	@ls -l dist/pyspark_dstl-*

# A local standalone cluster (master + 2 workers), the pipeline demo through spark-submit on it with
# --verify, every process stopped by PID (scripts/cluster_demo.py).
cluster-demo: dist
	$(PY) scripts/cluster_demo.py

bench: build
	$(PY) bench/report.py

# dstl beside Apache Flink 2.3's own DSTL (needs a JDK; downloads Flink's jars once to ~/.cache/dstl-bench).
.PHONY: bench-flink
bench-flink: build
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q "matplotlib>=3.5"
	$(PY) bench/flink/run.py

# ~45-60 min on 2 cores, outside `make test`: StatefulStream at 100k-4M keys (batch time, start ms,
# warm subtasks, driver and slot RSS), beside Spark's native state, a 740 MB batch on a 2 GB driver,
# and the catch-up a per-worker copy would replay (docs/benchmarks.md, "Scale"). SCALE_ARGS=--smoke:
# small sizes; SCALE_ARGS="--parts grid" one part.
SCALE_ARGS ?=
bench-scale: build
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q "matplotlib>=3.5"
	$(PY) bench/scale.py $(SCALE_ARGS)

# ~20+ min on 2 cores, outside `make test`: a long StatefulStream with SIGKILLs, sampled and charted
# (docs/benchmarks.md, "Soak"). SOAK_ARGS=--smoke for a quick check.
SOAK_ARGS ?=
soak: build
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q "matplotlib>=3.5"
	$(PY) bench/soak.py --results bench/results $(SOAK_ARGS)

# ~20+ min on 2 cores, outside `make test`: a local-cluster StatefulStream over 1M keys with its state on
# moto's S3 behind tests/s3proxy.py (10% throttled), 3 executor kills, a driver kill, a 60 s store
# outage (docs/benchmarks.md, "Soak at scale"). SOAK_SCALE_ARGS=--smoke for a quick check.
SOAK_SCALE_ARGS ?=
.PHONY: soak-scale
soak-scale: build
	$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q "matplotlib>=3.5"
	$(PY) bench/soak_scale.py --results bench/results $(SOAK_SCALE_ARGS)

clean:
	rm -rf build dist dstl/_fast/*.c dstl/_fast/*.so

# PySpark 3.5 (outside `make test`): a venv of its own with the latest pyspark 3.5.x (NumPy < 2, the
# range PySpark 3.5 supports) and this checkout installed with its test extra; the tests run from
# the checkout, with the extension `make build` compiled. The StatefulProcessor parts skip with a
# reason (transformWithState is Spark 4's). docs/spark.md, "Spark 3.5".
VENV35 ?= .venv-spark35
PY35 := $(VENV35)/bin/python
SPARK35_TESTS ?= tests/test_spark_placement.py::test_local_mode_keeps_every_subtask_warm_in_its_slot_and_survives_a_killed_slot_and_worker \
	tests/test_local_restore.py tests/test_stream.py tests/test_spark_units.py tests/test_spark_pipeline.py \
	tests/test_spark_routing.py tests/test_slots.py
.PHONY: test-spark35
test-spark35: build
	test -x $(PY35) || $(PYTHON) -m venv $(VENV35)
	$(PY35) -m pip install -q -U pip setuptools wheel
	$(PY35) -m pip install -q ".[test]" "pyspark>=3.5,<3.6" "numpy>=1.24,<2" "pyarrow>=14,<22"
	$(PY35) -c "import pyspark; assert pyspark.__version__.startswith('3.5.'), pyspark.__version__; print('pyspark', pyspark.__version__)"
	$(PY35) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) $(SPARK35_TESTS)
