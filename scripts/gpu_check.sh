#!/usr/bin/env bash
# The GPU check: what only a GPU can show, in ONE call on a lent GPU machine (the `device`
# tool's `run`; DEVELOPERS' brief: run it the first time a session has a GPU, and put the
# figures and the device in docs/benchmarks.md). Never part of the tests or CI.
#
#   bash scripts/gpu_check.sh            # writes $OUT/gpu_check.json + $OUT/gpu_check_logs.tgz
#
# The device tool brings back at most 8 files from $OUT, so the logs, summaries and probe file
# are written to a work folder and come back as one tarball.
#
# What it runs (each step's exit code is recorded; one failing step does not stop the others):
#   1. the device: nvidia-smi, and hetseq-hpc's pynvml probe (`hetseq-hpc probe task=bert`);
#   2. the NCCL rendezvous and 30 training steps of the small BERT at fp32, bf16 and fp16
#      (precision=<p>; fp16 with the job-wide loss scale), one rank per GPU;
#   3. the FSDP2 path on the GPU (sharding.mode=fsdp, NCCL), with activation checkpointing;
#   4. BERT-base (768 hidden, 12 layers, 12 heads, sequence 128) in bf16: samples/s and MFU
#      against the GPU's dense bf16 peak (hetseq_hpc/plan/gpus.py), compiled (trainer.compile=
#      auto compiles on a GPU) and eager (trainer.compile=off): compile_speedup;
#   5. a mixed-device job on this one machine (issue 43): tests/gpu/test_mixed_devices_cuda.py
#      (cluster.devices=[cuda,cpu]: rank 0 on the GPU, rank 1 on the CPU, gloo for all, the
#      small BERT for 20 steps in fp32 against one GPU rank, exact at 1e-5; its run directories
#      kept under a fixed --basetemp), then the same job in precision=auto (bf16 on the GPU,
#      fp32 on the CPU): each rank's device and measured share, and the worst relative loss
#      difference against the 1-rank run; three small runs, ~1-2 min; MIXED=0 skips it;
#   6. the other tests that need CUDA (tests/gpu: pynvml probe, exact accumulation and FSDP =
#      DDP in fp32 on the GPU, bf16/fp16 against fp32, host syncs).
#   7. an ordinary LightningModule with HetSeqStrategy on the GPU (examples/lightning_mlp.py
#      --accelerator gpu --devices 1): Lightning's own loop at the engine's exact batch.
# STEPS (default 30) sets the small runs' steps; a dry run on a CPU: STEPS=3 BERT_STEPS=2.
# BUDGET (seconds, default none) caps the whole script: the pytest steps get what is left
# (less 30 s for the summary), so the JSON and logs come back inside the device call's limit.
# The GPU machine has PyTorch but not every dependency of hetseq_hpc (hydra-core, omegaconf,
# antlr4-python3-runtime, submitit, django ...), and cannot download: build them HERE first,
# for the machine's Python (3.12), into .whl/ (ignored by git, carried with carry=[".whl"]):
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.2 omegaconf==2.3.0 \
#     submitit==1.5.4 django asgiref sqlparse   # (sacrebleu, portalocker: there already)
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # an sdist: build it here
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/gpu-check}
OUT=$(mktemp -d /tmp/gpu-check-work.XXXX)
mkdir -p "$FINAL"
STEPS=${STEPS:-30}
BERT_STEPS=${BERT_STEPS:-40}
MIXED=${MIXED:-1}
BUDGET=${BUDGET:-0}
left() {  # seconds the next step may take: what BUDGET leaves (30 s kept for the summary)
  if [ "$BUDGET" -gt 0 ]; then echo $(( BUDGET - SECONDS - 30 > 10 ? BUDGET - SECONDS - 30 : 10 )); else echo 300; fi
}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HETSEQ_CACHE=${HETSEQ_CACHE:-/tmp/hetseq-cache}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
SMALL="task.model.hidden_size=64 task.model.num_layers=2 task.model.num_heads=2 task.model.intermediate_size=128 task.model.max_seq_len=64 trainer.val_every=0 trainer.plot=false"
declare -A RC

step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember the exit code
  local name=$1; shift
  echo "== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  RC[$name]=$?
  tail -n 3 "$OUT/$name.log"
}

step smi nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
step probe "$PY" -m hetseq_hpc probe task=bert $SMALL --out "$OUT/probe.json"
for p in fp32 bf16 fp16; do
  step "train_$p" "$PY" -m hetseq_hpc $SMALL precision=$p trainer.max_steps=$STEPS \
    hydra.run.dir=/tmp/gpu-check-runs/$p
  cp /tmp/gpu-check-runs/$p/summary.json "$OUT/summary_$p.json" 2>/dev/null
done
step fsdp "$PY" -m hetseq_hpc $SMALL sharding.mode=fsdp sharding.activation_checkpointing=true \
  trainer.max_steps=$STEPS hydra.run.dir=/tmp/gpu-check-runs/fsdp
cp /tmp/gpu-check-runs/fsdp/summary.json "$OUT/summary_fsdp.json" 2>/dev/null
step bert_base "$PY" -m hetseq_hpc task.model.hidden_size=768 task.model.num_layers=12 \
  task.model.num_heads=12 task.model.intermediate_size=3072 task.model.max_seq_len=128 \
  precision=bf16 trainer.global_batch_size=256 trainer.max_steps=$BERT_STEPS trainer.val_every=0 \
  trainer.plot=false hydra.run.dir=/tmp/gpu-check-runs/bert_base
cp /tmp/gpu-check-runs/bert_base/summary.json "$OUT/summary_bert_base.json" 2>/dev/null
# the same eager (trainer.compile=auto compiles on a GPU: the run above is the compiled one)
step bert_base_eager "$PY" -m hetseq_hpc task.model.hidden_size=768 task.model.num_layers=12 \
  task.model.num_heads=12 task.model.intermediate_size=3072 task.model.max_seq_len=128 \
  precision=bf16 trainer.global_batch_size=256 trainer.max_steps=$BERT_STEPS trainer.val_every=0 \
  trainer.compile=off trainer.plot=false hydra.run.dir=/tmp/gpu-check-runs/bert_base_eager
cp /tmp/gpu-check-runs/bert_base_eager/summary.json "$OUT/summary_bert_base_eager.json" 2>/dev/null
# a GPU rank and a CPU rank over gloo against one GPU rank: the test (exact in fp32), then auto
MIXED_TMP=/tmp/gpu-check-runs/mixed_test
if [ "$MIXED" != 0 ]; then
  step mixed_test timeout "$(left)" "$PY" -m pytest -n 0 tests/gpu/test_mixed_devices_cuda.py -q -rA \
    -p no:cacheprovider --basetemp=$MIXED_TMP
  # the test's job (its EXACT settings) with each rank's own precision: bf16 GPU, fp32 CPU
  step mixed_auto "$PY" -m hetseq_hpc $SMALL task.model.dropout=0.0 trainer.seed=7 \
    trainer.global_batch_size=32 trainer.compile=off trainer.max_steps=20 precision=auto \
    "cluster.devices=[cuda,cpu]" hydra.run.dir=/tmp/gpu-check-runs/mixed_auto
  for pair in "ref:$MIXED_TMP/*/one" "fp32:$MIXED_TMP/*/mixed" \
    "auto:/tmp/gpu-check-runs/mixed_auto"; do
    for d in ${pair#*:}; do  # the test's run directories: one tmp_path under --basetemp
      cp "$d/metrics.jsonl" "$OUT/metrics_mixed_${pair%%:*}.jsonl" 2>/dev/null
      cp "$d/allocation.json" "$OUT/allocation_mixed_${pair%%:*}.json" 2>/dev/null
    done
  done
fi
step lightning_gpu timeout "$(left)" "$PY" examples/lightning_mlp.py --accelerator gpu \
  --devices 1 --global-batch-size 32 --max-steps 20
# the host-sync test first: the others ran on earlier machines (docs/benchmarks.md)
step tests_cuda timeout "$(left)" "$PY" -m pytest -n 0 -q -rA -p no:cacheprovider \
  tests/gpu/test_step_syncs_cuda.py tests/gpu/test_cuda_runs.py

rcs=""
for k in "${!RC[@]}"; do rcs="$rcs\"$k\": ${RC[$k]}, "; done
"$PY" - "$OUT" "{${rcs%, }}" <<'EOF'
import json, sys
from pathlib import Path

out, rcs = Path(sys.argv[1]), json.loads(sys.argv[2])
result = {"exit_codes": rcs, "device": (out / "smi.log").read_text().strip().splitlines()[-1:]}
for name in ("fp32", "bf16", "fp16", "fsdp", "bert_base", "bert_base_eager"):
    path = out / f"summary_{name}.json"
    if path.exists():
        s = json.loads(path.read_text())
        result[name] = {k: s.get(k) for k in ("samples_per_s", "steady_samples_per_s",
                                              "fit_samples_per_s", "mfu", "final_loss",
                                              "precisions", "sharding", "memory", "compile")}
        result[name]["train_tflops_per_s"] = (s.get("task") or {}).get("train_tflops_per_s")
eager = (result.get("bert_base_eager") or {}).get("steady_samples_per_s")
compiled = (result.get("bert_base") or {}).get("steady_samples_per_s")
if eager and compiled:  # steady-state samples/s, compiled over eager
    result["compile_speedup"] = round(compiled / eager, 3)

def step_losses(path: Path) -> dict:
    rows = (json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line)
    return {row["step"]: row["loss"] for row in rows}


ref = out / "metrics_mixed_ref.jsonl"
for p in ("fp32", "auto"):  # the mixed-device job against one GPU rank in fp32
    metrics, alloc = out / f"metrics_mixed_{p}.jsonl", out / f"allocation_mixed_{p}.json"
    if not (ref.exists() and metrics.exists() and alloc.exists()):
        continue
    a, b, doc = step_losses(ref), step_losses(metrics), json.loads(alloc.read_text())
    shares = {s["rank"]: s for s in doc["allocation"]["shares"]}
    common = sorted(set(a) & set(b))
    worst = max((abs(a[k] - b[k]) / abs(a[k]) for k in common), default=None)
    result[f"mixed_{p}"] = {
        "ranks": [
            {"rank": r["rank"], "kind": r["probe"]["kind"], "device": r["device"],
             "precision": r["precision"], "samples": shares[r["rank"]]["samples"],
             "micro_batch": shares[r["rank"]]["micro_batch"],
             "accum_steps": shares[r["rank"]]["accum_steps"]}
            for r in doc["ranks"]
        ],
        "source": doc["allocation"]["source"],
        "throughputs": doc["allocation"].get("throughputs"),
        "steps_compared": len(common),
        "worst_rel_loss_diff": worst,
    }
    if p == "fp32":  # the exactness bar of the CPU and GPU tests (tests/helpers/runs.py)
        result[f"mixed_{p}"]["exact_1e-5"] = worst is not None and worst <= 1e-5
try:
    import torch

    from hetseq_hpc.plan.gpus import lookup_gpu, peak_tflops

    gpu = lookup_gpu(torch.cuda.get_device_name(0), "gpu_check")  # the NVML product name
    peak = peak_tflops(gpu, "bf16")
    achieved = (result.get("bert_base") or {}).get("train_tflops_per_s")
    if achieved:
        result["bert_base"]["mfu_bf16"] = round(achieved / peak, 4)
        result["bert_base"]["peak_bf16_tflops"] = peak
except Exception as exc:  # an unknown GPU name: the figures above still stand
    result["mfu_note"] = f"no MFU: {type(exc).__name__}: {exc}"
(out / "gpu_check.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result))
EOF
cp "$OUT/gpu_check.json" "$FINAL/gpu_check.json"
tar czf "$FINAL/gpu_check_logs.tgz" -C "$OUT" .
