# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export RAY_ENABLE_UV_RUN_RUNTIME_ENV := 0
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export PYTHONUNBUFFERED := 1

.PHONY: demo test install teacher av-teacher av-kf-teacher av-ref-teacher bench bench-av serve clean

# uv (a PyPI package, installed by pip) installs the same pins as pip in well under half its time
# (bench/README.md). It does not read pip's configuration, so the wheel folders pip is told of
# (find-links: where a machine keeps the CPU build of torch) are passed on. Where uv cannot install
# (no PyPI, an index only pip is configured for), pip does it as before.
# --compile-bytecode, as pip does by default: uv leaves every .py to be compiled on first import,
# and where PYTHONDONTWRITEBYTECODE is set (these machines set it) that happens again in every
# process: every Ray trainer, flow run and server of a run or of the suite paid ~2x its imports
# (torch, diffusers, prefect and ray: 15.4 s of CPU against 7.6 s compiled).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	links=$$($(PY) -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$$/\1/p" | tr ' ' '\n' | sort -u); \
	{ $(PY) -m pip install -q uv && \
	  $(PY) -m uv pip install -q --compile-bytecode --python $(PY) $$(for l in $$links; do printf -- '--find-links %s ' "$$l"; done) -e '.[test]'; } || \
	{ echo "uv could not install; pip installs instead"; \
	  $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e '.[test]'; }
	touch $(STAMP)

install: $(STAMP)

teacher: $(STAMP)
	$(PY) -m dmd2_core.toys.digits_teacher --save runs/teacher --reuse --table

# the small MiniMax-H3 teacher of sounding digits (bench/quality_av.py), reused when present; then
# whether its weights are the tests' fixture to the bit (the recorded sha256). A mismatch is said
# and not fatal (the leading -): another CPU or torch build may round otherwise; the tests keep the fixture
AV_FIXTURE := tests/fixtures/av_teacher
av-teacher: $(STAMP)
	$(PY) -m dmd2_core.toys.sounding_digits_teacher --save runs/av-teacher --reuse --table
	-$(PY) -m dmd2_core.toys.sounding_digits_teacher --save runs/av-teacher --reuse --check-fixture $(AV_FIXTURE)

# the same with keyframes (MiniMax-H3's fl2va: each clip conditioned on its own first and last frames)
AV_KF_FIXTURE := tests/fixtures/av_kf_teacher
av-kf-teacher: $(STAMP)
	$(PY) -m dmd2_core.toys.sounding_digits_teacher --workflow fl2va --save runs/av-kf-teacher --reuse --table
	-$(PY) -m dmd2_core.toys.sounding_digits_teacher --workflow fl2va --save runs/av-kf-teacher --reuse --check-fixture $(AV_KF_FIXTURE)

# the same with references (MiniMax-H3's ref2va: a prompt naming no digit, a picture of the digit as the
# reference; the weights in transformer_ref/, as H3's own ref2va partition)
AV_REF_FIXTURE := tests/fixtures/av_ref_teacher
av-ref-teacher: $(STAMP)
	$(PY) -m dmd2_core.toys.sounding_digits_teacher --workflow ref2va --save runs/av-ref-teacher --reuse --table
	-$(PY) -m dmd2_core.toys.sounding_digits_teacher --workflow ref2va --save runs/av-ref-teacher --reuse --check-fixture $(AV_REF_FIXTURE)

# the project's own modules compiled too (a stat per file when nothing changed): every trainer
# process imports them, and with PYTHONDONTWRITEBYTECODE nothing else keeps their bytecode
COMPILE_PROJECT := $(PY) -m compileall -q -j 0 dmd2_core flows tasks deployments > /dev/null

demo: $(STAMP)
	$(COMPILE_PROJECT)
	$(PY) -m flows.demo

# Two passes. First every test but the multi_rank ones, on TEST_WORKERS processes (pytest-xdist;
# most tests wait on Ray actors, servers and subprocesses, so two workers use the two cores CI has).
# Then the multi_rank tests (groups of 2+ gloo ranks), alone on the machine: ranks wait on each
# other in every collective, so beside other work each stalls and stalls it (in one pass on 2 cores
# they took ~4x their time alone, 360 s for all 22, and a served night beside them 430 s against
# 89 s alone). An interrupted first pass (Ctrl-C, a kill, a usage error) ends there. pytest exits 5
# when it collects no test: in one pass that is a selection (PYTEST_ARGS) that names no test of it;
# in both it is a failure of the suite, reported as such.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(COMPILE_PROJECT)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not multi_rank" --durations=15 $(PYTEST_ARGS); first=$$?; \
	case $$first in 0|1|5) ;; *) exit $$first;; esac; \
	$(PY) -m pytest -q -m multi_rank --durations=5 $(PYTEST_ARGS); second=$$?; \
	if [ $$first -eq 5 ] && [ $$second -eq 5 ]; then echo "pytest collected no tests"; exit 5; fi; \
	[ $$first -eq 5 ] && first=0; [ $$second -eq 5 ] && second=0; \
	exit $$(( first > second ? first : second ))

bench: $(STAMP)
	$(PY) bench/quality.py
	$(PY) bench/overhead.py
	$(PY) bench/orchestration.py

bench-av: $(STAMP)
	$(PY) bench/quality_av.py --progress runs/bench-quality-av.jsonl

# A local Prefect server on 127.0.0.1:4200 (unless PREFECT_API_URL points at one) and the serve
# process; then, in another shell: prefect deployment run dmd2/tiny --watch
serve: $(STAMP)
	$(PY) -m deployments.serve --local-server 4200

clean:
	rm -rf runs .pytest_cache
