#!/usr/bin/env bash
# The project's one test command (README.md; CI's .ci/run calls exactly this).
#
#   bash scripts/run-tests.sh [pytest args...]
#
# On a fresh machine it creates .venv, installs torch==2.13.0 FIRST (the CPU wheel; nothing may
# pull another torch), then the package with its test extra, while it starts its OWN single-host
# Slurm test cluster beside the install (scripts/test-cluster.sh; tests that need it skip,
# saying why, if Slurm cannot be installed here), runs pytest, and stops that cluster again.
#
# Safe on a shared host: the cluster gets a fresh state directory (mktemp, or
# $HETSEQ_TESTCLUSTER_DIR if you set it) and free ports, so two clones (or two users) running
# this at once each test against their own cluster, and each stops only its own. A cluster
# already running in $HETSEQ_TESTCLUSTER_DIR is used and left running.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

cluster_started=0
cluster_dir_made=0
cluster_job=
cluster_wanted=0
if [ -x scripts/test-cluster.sh ] && [ "${HETSEQ_SKIP_SLURM:-0}" != 1 ]; then
  cluster_wanted=1
  if [ -z "${HETSEQ_TESTCLUSTER_DIR:-}" ]; then
    HETSEQ_TESTCLUSTER_DIR=$(mktemp -d /tmp/hetseq-testcluster.XXXXXX)
    cluster_dir_made=1
  fi
  export HETSEQ_TESTCLUSTER_DIR
  already_up=0
  if scripts/test-cluster.sh status >/dev/null 2>&1; then already_up=1; fi
  # the cluster starts (on a fresh machine: apt-get installs Slurm and munge) while pip
  # installs the venv below: neither needs the other
  cluster_result=$(mktemp)
  (
    code=0
    scripts/test-cluster.sh start > "$cluster_result.out" 2>&1 || code=$?
    echo "$code" > "$cluster_result"
  ) &
  cluster_job=$!
fi
stop_cluster() {
  local rc=$?
  if [ -n "$cluster_job" ]; then  # still starting: let it finish, then stop what it started
    wait "$cluster_job" 2>/dev/null || true
    cluster_job=
    if [ "$already_up" = 0 ] && [ "$(cat "$cluster_result" 2>/dev/null)" = 0 ]; then
      cluster_started=1
    fi
  fi
  if [ "$cluster_started" = 1 ]; then scripts/test-cluster.sh stop >/dev/null 2>&1 || true; fi
  if [ "$cluster_dir_made" = 1 ]; then
    if [ "$rc" = 0 ] || [ "$cluster_started" = 0 ]; then
      rm -rf "$HETSEQ_TESTCLUSTER_DIR"
    else
      echo "the test cluster's logs are kept in $HETSEQ_TESTCLUSTER_DIR/log" >&2
    fi
  fi
  if [ "$cluster_wanted" = 1 ]; then rm -f "$cluster_result" "$cluster_result.out"; fi
  return "$rc"
}
trap stop_cluster EXIT

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e '.[test]'
# guard: the installed torch must still be the one we asked for
"$VENV/bin/python" -c 'import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith("2.13.0") else f"torch {v} was installed instead of 2.13.0")'

# byte-compile the checkout once: where PYTHONDONTWRITEBYTECODE=1 (set on our 2-core VMs)
# every process of the suite (hundreds of launchers and ranks) compiled the package's sources
# again; a .pyc is still read there, and one whose source changed is ignored
"$VENV/bin/python" -m compileall -q hetseq_hpc tests > /dev/null

# lint first (while the test cluster may still be starting): a style error fails in seconds,
# not after the suite
"$VENV/bin/python" -m ruff check hetseq_hpc tests scripts examples
"$VENV/bin/python" -m ruff format --check hetseq_hpc tests scripts examples
# module docstrings stay short (<= 20 lines); the design essays live in docs/design/
"$VENV/bin/python" scripts/check_docstrings.py
# the import-layer contract (pyproject.toml [tool.importlinter]): no package imports one above it
"$VENV/bin/lint-imports"

if [ -n "$cluster_job" ]; then
  wait "$cluster_job" || true
  cluster_job=
  out=$(cat "$cluster_result.out")
  code=$(cat "$cluster_result")
  if [ "$code" = 0 ]; then
    if [ "$already_up" = 0 ]; then cluster_started=1; fi
    eval "$(printf '%s\n' "$out" | tail -n 1)"   # export SLURM_CONF=<its state dir>/etc/slurm.conf
    export HETSEQ_TESTCLUSTER=1
    echo "Slurm test cluster: $HETSEQ_TESTCLUSTER_DIR (SLURM_CONF=$SLURM_CONF)" >&2
  else
    printf '%s\n' "$out" | tail -n 20 >&2
    reason=$(printf '%s\n' "$out" | tail -n 1)
    if [ "$code" != 3 ] && [ "${CI:-}" = true ]; then
      # exit 3 = Slurm cannot be installed/run here (the only allowed skip); anything else is a
      # broken test cluster, which must not pass CI silently
      echo "error: the Slurm test cluster failed to start (exit $code): $reason" >&2
      exit 1
    fi
    export HETSEQ_TESTCLUSTER_UNAVAILABLE="Slurm test cluster unavailable (exit $code): $reason"
    echo "warning: $HETSEQ_TESTCLUSTER_UNAVAILABLE; the Slurm tests will skip" >&2
  fi
fi

side=$(mktemp -d)   # the logs of the checks that run beside pytest
# the type check of the core packages (pyproject.toml [tool.mypy]): ~20 s of one core without
# its cache, so beside the tests (its log shown, and its failure counted, after them)
"$VENV/bin/python" -m mypy hetseq_hpc/balance hetseq_hpc/distributed hetseq_hpc/train \
  > "$side/mypy.log" 2>&1 &
mypy_pid=$!
wheel_pid=
if [ "${CI:-}" = true ]; then
  # the built wheel, installed elsewhere, finds conf/ and trains: beside the tests (it mostly
  # waits on pip), its log shown after them
  bash scripts/check_wheel.sh > "$side/wheel.log" 2>&1 &
  wheel_pid=$!
fi

extra=()
if [ "${CI:-}" = true ]; then
  extra=(--durations=30)   # the CI log names the slowest tests (the suite must stay well in 90 min)
fi
# Parallel (pytest-xdist, CONTRIBUTING.md): the Slurm tier waits on its scheduler far more than
# it computes, so it runs as its own pytest, its tests one after the other against the one test
# cluster, beside a pytest of the other tiers on $HETSEQ_TEST_WORKERS workers (3; xdist's
# default "load" hands tests out from the front, the longest files first: tests/conftest.py;
# "worksteal" splits the list into a block per worker and ran longer, 4 workers too). With pytest
# arguments, or HETSEQ_TEST_WORKERS=0 (everything in one process), it is one pytest.
# --maxschedchunk 2: xdist's "load" otherwise starts each worker on a block of a quarter of its
# share (~125 consecutive tests): the first block held every long test, and that worker ended
# 7 minutes after the others (CI run 19); handed out two at a time, the workers end together.
workers=${HETSEQ_TEST_WORKERS:-3}
rc=0
if [ "$workers" != 0 ] && [ $# = 0 ] && [ "${HETSEQ_TESTCLUSTER:-}" = 1 ]; then
  "$VENV/bin/python" -m pytest tests/slurm -n 0 --basetemp "$side/slurm-tmp" \
    ${extra[@]+"${extra[@]}"} > "$side/slurm.log" 2>&1 &
  slurm_pid=$!
  "$VENV/bin/python" -m pytest --all --ignore=tests/slurm -n "$workers" --dist load \
    --maxschedchunk 2 ${extra[@]+"${extra[@]}"} || rc=$?
  slurm_rc=0
  wait "$slurm_pid" || slurm_rc=$?
  echo "=================== the Slurm tier (tests/slurm, beside the above) ==================="
  cat "$side/slurm.log"
  echo "run-tests: unit/integration/gpu tiers exit $rc, Slurm tier exit $slurm_rc"
  if [ "$rc" = 0 ]; then rc=$slurm_rc; fi
else
  if [ "$workers" != 0 ]; then
    extra+=(-n "$workers" --dist loadgroup --maxschedchunk 2)
  else
    extra+=(-n 0)   # one process (setup.cfg's -n auto otherwise)
  fi
  # --all: every tier (bare `pytest` runs only tests/unit; CONTRIBUTING.md)
  "$VENV/bin/python" -m pytest --all ${extra[@]+"${extra[@]}"} "$@" || rc=$?
fi
# a check that ran beside the tests: wait for it, show its log, count its failure
wait_beside() {  # pid, log file, name
  local code=0
  wait "$1" || code=$?
  cat "$2"
  if [ "$code" != 0 ]; then
    echo "run-tests: $3 failed (exit $code)" >&2
    if [ "$rc" = 0 ]; then rc=$code; fi
  fi
}
wait_beside "$mypy_pid" "$side/mypy.log" mypy
if [ -n "$wheel_pid" ]; then
  wait_beside "$wheel_pid" "$side/wheel.log" scripts/check_wheel.sh
fi
rm -rf "$side"
exit "$rc"
