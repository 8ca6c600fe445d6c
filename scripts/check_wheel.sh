#!/usr/bin/env bash
# Packaging check (issue 21): build the wheel, install it (NOT editable) into a fresh venv, and
# run a 5-step job from a folder outside the checkout, so that the package finds every config
# group through its own copy of conf/ (package data: hetseq_hpc/conf/, which the checkout's conf/
# links to).
#
#   bash scripts/check_wheel.sh            # exit 0 when the installed wheel trains
#
# run-tests.sh calls it in CI (CI=true). The fresh venv gets the wheel alone (--no-deps), put
# there by the project venv's pip (`pip --python`). Its dependencies are the project venv's
# (.venv: torch==2.13.0 and the rest, installed and resolved by run-tests.sh), seen through one
# .pth line rather than installed a second time (two pip installs cost ~110 CPU-s of CI's two
# cores); `pip check` proves every requirement the wheel declares is met. A .pth line adds a
# folder to sys.path without running the .pth files in it, so the checkout's editable install
# stays out of sight.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m pip wheel --no-deps -q -w "$work/dist" . >/dev/null
"$PYTHON" -m venv --without-pip "$work/venv"   # its pip and setuptools would shadow the project's
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
.venv/bin/python -c "$purelib" > "$("$work/venv/bin/python" -c "$purelib")/project_deps.pth"
pip_there=(.venv/bin/python -m pip --python "$work/venv/bin/python")
"${pip_there[@]}" install -q --no-deps "$work"/dist/hetseq_hpc-*.whl
"${pip_there[@]}" check > "$work/check.log" 2>&1 || {
  cat "$work/check.log" >&2; echo "check_wheel: the wheel's requirements are not met" >&2; exit 1; }
mkdir "$work/elsewhere"
cd "$work/elsewhere"
HETSEQ_CACHE="$work/cache" "$work/venv/bin/hetseq-hpc" run task=bert trainer.max_steps=5 \
  trainer.val_every=0 "hydra.run.dir=$work/run" > "$work/out.log" 2>&1 || {
  tail -n 20 "$work/out.log" >&2; echo "check_wheel: the installed wheel did not train" >&2; exit 1; }
"$work/venv/bin/python" - "$work/run" <<'PY'
import json, pathlib, sys
import hetseq_hpc
run = pathlib.Path(sys.argv[1])
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
where = pathlib.Path(hetseq_hpc.__file__).resolve()
assert "site-packages" in str(where), f"imported from {where}, not the installed wheel"
assert [r["step"] for r in rows] == [1, 2, 3, 4, 5], rows
print(f"check_wheel: installed wheel ({where.parent}) trained 5 steps outside the checkout")
PY
