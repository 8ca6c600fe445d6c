"""Print the GPU spec model's accuracy tables (docs/planner-accuracy.md) from the code as it is.

    .venv/bin/python scripts/planner_accuracy.py            # every table
    .venv/bin/python scripts/planner_accuracy.py --classes  # the per-class table and the bars only

Nothing here is fitted: the factors are :data:`hetseq_hpc.plan.perf_model.FACTORS` (the fit rows
only); every held-out row is scored with :func:`hetseq_hpc.plan.perf_model.predicted`, and the
HetSeq step times come from ``plan`` itself (tests/unit/test_plan_hetseq.py asserts the bars).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetseq_hpc.plan import perf_model as pm

WITHIN = 0.20


def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%"


def rows_table() -> None:
    print(
        "| role | GPU (spec row) | precision | BERT | batch | published seq/s | predicted | error "
        "| time split | source |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in pm.published():
        pred = pm.predicted(r)
        split = pm.bound_label(pm.sample_time_s(r.spec, r.precision, r.flops, r.accesses))
        src = r.source_url.split("/")[3] + "@" + r.source_url.split("/blob/")[1].split("/")[0][:8]
        print(
            f"| {r.role} | {r.spec.label} | {r.precision} | {r.model} | {r.batch} | "
            f"{r.samples_per_s:g} | {pred:.1f} | {_pct(pred / r.samples_per_s - 1)} | {split} "
            f"| {src} |"
        )


def classes_table() -> None:
    errors = pm.heldout_errors()
    print("| class | held-out rows | median abs error | errors |")
    print("|---|---|---|---|")
    ok = 0
    for cls in sorted(errors):
        med = statistics.median(abs(e) for e in errors[cls])
        ok += med <= WITHIN
        miss = " **miss**" if med > WITHIN else ""
        print(
            f"| {cls} | {len(errors[cls])} | {med * 100:.0f}%{miss} | "
            f"{', '.join(_pct(e) for e in errors[cls])} |"
        )
    every = [abs(e) for errs in errors.values() for e in errs]
    print(
        f"\n{len(every)} held-out rows: median absolute error {statistics.median(every) * 100:.1f} %;"
        f" classes within 20 %: {ok} of {len(errors)}; factors {pm.FACTORS}, "
        f"t0 = {pm.PASS_OVERHEAD_S_PER_TENSOR * 1e3:.4f} ms per parameter tensor "
        f"(base {pm.pass_overhead_s(pm.BERT_PARAM_TENSORS['base']) * 1e3:.1f} ms, "
        f"large {pm.pass_overhead_s(pm.BERT_PARAM_TENSORS['large']) * 1e3:.1f} ms)"
    )
    a100 = [
        e for a, b, src in pm.A100_V100_PAIRS for e in pm.heldout_ratio_errors(a, b, "fp16", src)
    ]
    print(
        f"A100:V100 fp16 ratio errors: {', '.join(_pct(e) for e in a100)}; median |error| "
        f"{statistics.median(abs(e) for e in a100) * 100:.1f} %"
    )
    t4 = next(r for r in pm.published() if r.gpu == "t4")
    v100 = next(r for r in pm.published() if "siasosp23" in r.source_url)
    pred, pub = pm.predicted(v100) / pm.predicted(t4), v100.samples_per_s / t4.samples_per_s
    print(f"V100:T4 fp32: predicted {pred:.2f} vs published {pub:.2f} ({_pct(pred / pub - 1)})")


def hetseq_table() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
    # the test's own plan and HetSeq's README figures, not a copy
    from test_plan_hetseq import (
        OWN_BERT_BASE,
        _plan,
        _predicted_step_s,
        hetseq_model,
        one_node_probe,
        same_die_cross_check,
    )
    from test_plan_hetseq import PUBLISHED_STEP_S as HETSEQ_STEP_S

    model = hetseq_model()  # HetSeq's own BERT (examples/hetseq_bert.py), the user's token cache
    steps = {n: _predicted_step_s(n, model) for n in HETSEQ_STEP_S}
    own = {n: _predicted_step_s(n, OWN_BERT_BASE) for n in HETSEQ_STEP_S}
    print(
        "| nodes | published step s | predicted (HetSeq's BERT) | error | published "
        "step(N)/step(1) | predicted | error | hetseq_hpc's BERT-base: step | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n, pub in HETSEQ_STEP_S.items():
        scale, pub_scale = steps[n] / steps[1], pub / HETSEQ_STEP_S[1]
        print(
            f"| {n} | {pub} | {steps[n]:.2f} | {_pct(steps[n] / pub - 1)} | {pub_scale:.3f} | "
            f"{scale:.3f} | {_pct(scale / pub_scale - 1)} | {own[n]:.2f} | "
            f"{_pct(own[n] / pub - 1)} |"
        )
    print()
    print(
        "With the 1-node figure as the probe of partition xp (plan.probe=; 8 nodes: p100 from "
        "specs x the xp ratio), HetSeq's BERT:"
    )
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "xp_probe.json"
        rate = one_node_probe(probe, model)
        print(f"probe rate = {rate:.3f} x the spec model's per-sample rate")
        print("| link Gbit/s | " + " | ".join(f"{n} nodes" for n in HETSEQ_STEP_S) + " |")
        print("|---|" + "---|" * len(HETSEQ_STEP_S))
        for link in (5, 10, 25, 100):
            cells = []
            for n, pub in HETSEQ_STEP_S.items():
                step = _plan(n, model, link, str(probe)).prediction.equal.step_s
                cells.append(f"{step:.3f} s ({_pct(step / pub - 1)})")
            print(f"| {link} | " + " | ".join(cells) + " |")
    print()
    print(
        "The same die (GP102), fp32, published twice (HetSeq's TITAN Xp step; Lambda's held-out "
        "GTX 1080 Ti BERT-base row):"
    )
    print("| figure | share of fp32 peak FLOP/s | element accesses per FLOP | spec model's error |")
    print("|---|---|---|---|")
    for name, c in same_die_cross_check(model).items():
        print(
            f"| {name} | {c['peak_share']:.1%} | {c['accesses_per_flop']:.2e} | "
            f"{_pct(c['error'])} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", action="store_true", help="the class table and bars only")
    args = parser.parse_args()
    if not args.classes:
        rows_table()
        print()
    classes_table()
    if not args.classes:
        print()
        hetseq_table()


if __name__ == "__main__":
    main()
