#!/usr/bin/env bash
# The project's one test command (README.md; CI's .ci/run calls exactly this).
#
#   bash scripts/run-tests.sh [pytest args...]
#
# On a fresh machine it creates .venv, installs torch==2.13.0 FIRST (the CPU wheel; nothing may
# pull another torch), then the package with its test extra, starts the single-host Slurm test
# cluster (scripts/test-cluster.sh; tests that need it skip, saying why, if Slurm cannot be
# installed here), runs pytest, and stops the cluster again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e '.[test]'
# guard: the installed torch must still be the one we asked for
"$VENV/bin/python" -c 'import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith("2.13.0") else f"torch {v} was installed instead of 2.13.0")'

cluster_started=0
if [ -x scripts/test-cluster.sh ] && [ "${HETSEQ_SKIP_SLURM:-0}" != 1 ]; then
  if out=$(scripts/test-cluster.sh start 2>&1); then
    cluster_started=1
    eval "$(printf '%s\n' "$out" | tail -n 1)"   # export SLURM_CONF=...
    export HETSEQ_TESTCLUSTER=1
  else
    code=$?
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
stop_cluster() {
  if [ "$cluster_started" = 1 ]; then scripts/test-cluster.sh stop >/dev/null 2>&1 || true; fi
}
trap stop_cluster EXIT

# lint first: a style error fails in a second, not after the suite
"$VENV/bin/python" -m ruff check hetseq_hpc tests scripts examples
# the import-layer contract (pyproject.toml [tool.importlinter]): no package imports one above it
"$VENV/bin/lint-imports"

"$VENV/bin/python" -m pytest "$@"
