"""The planner (hetseq_hpc.plan) in-process: the cost model against hand calculations, planning
from a probe, the datasheet and this CPU. (The planner's command line:
tests/integration/test_plan_cli.py.)"""

from __future__ import annotations

import json

import pytest

from hetseq_hpc import plan
from hetseq_hpc.errors import ConfigError
from tests.helpers.runs import SMALL_MODEL

BERT_BASE = [
    "task.model.hidden_size=768",
    "task.model.num_layers=12",
    "task.model.num_heads=12",
    "task.model.intermediate_size=3072",
]


def _probe(*ranks):
    """A probe-like allocation.json: (partition, gres, samples/s) per rank."""
    return {
        "ranks": [
            {
                "rank": i,
                "partition": p,
                "gres": g,
                "device": f"cuda:0 {g}",
                "calibration": {"samples_per_s": t, "max_micro_batch": 64},
            }
            for i, (p, g, t) in enumerate(ranks)
        ]
    }


def test_prediction_matches_a_hand_calculation():
    # two partitions: "fast" = 1 rank at 300 samples/s, "slow" = 2 ranks at 100 samples/s
    parts = [
        plan.PartitionSpec("fast", "fast", "a100", 1),
        plan.PartitionSpec("slow", "slow", "t4", 2),
    ]
    probe = _probe(("fast", "a100", 300.0), ("slow", "t4", 90.0), ("slow", "t4", 110.0))
    ranks = plan.ranks_from_probe(probe, parts)
    assert [r.samples_per_s for r in ranks] == [300.0, 100.0, 100.0]  # median of 90 and 110
    assert [r.partition for r in ranks] == ["fast", "slow", "slow"]

    grad_bytes, gbps, latency = 10e6, 8.0, 10e-6  # 10 MB of gradients over 1 GB/s links
    pred = plan.predict(
        [r.samples_per_s for r in ranks],
        50,
        [r.max_micro_batch for r in ranks],
        grad_bytes,
        gbps,
        latency,
        overlap=0.0,
    )
    # by hand: ring all-reduce, N = 3: 2 * 2/3 * 10e6 B / 1e9 B/s + 2 * 2 * 10 us
    allreduce = 2 * 2 / 3 * 10e6 / 1e9 + 4 * 10e-6  # = 0.013333 + 0.00004 = 0.0133733 s
    assert pred.allreduce_s == pytest.approx(allreduce)
    # balanced: 50 samples in proportion 3:1:1 -> [30, 10, 10], each rank busy 0.1 s
    assert pred.balanced.allocation.samples == [30, 10, 10]
    assert pred.balanced.compute_s == pytest.approx((0.1, 0.1, 0.1))
    assert pred.balanced.step_s == pytest.approx(0.1 + allreduce)
    assert pred.balanced.samples_per_s == pytest.approx(50 / 0.1133733, rel=1e-6)  # 441.02
    # equal split: [17, 17, 16] -> the slow rank with 17 samples takes 0.17 s
    assert pred.equal.allocation.samples == [17, 17, 16]
    assert pred.equal.step_s == pytest.approx(0.17 + allreduce)
    assert pred.equal.samples_per_s == pytest.approx(50 / 0.1833733, rel=1e-6)  # 272.67
    # ideal = 300 + 100 + 100; efficiency = 441.02 / 500; speedup = 0.1833733 / 0.1133733
    assert pred.ideal_samples_per_s == 500.0
    assert pred.efficiency == pytest.approx(50 / 0.1133733 / 500, rel=1e-6)  # 0.882
    assert pred.speedup_vs_equal == pytest.approx(0.1833733 / 0.1133733, rel=1e-6)  # 1.617
    assert pred.allreduce_share == pytest.approx(0.0133733 / 0.1133733, rel=1e-5)  # 0.118
    # half of the all-reduce hidden behind backward
    half = plan.predict([300.0, 100.0, 100.0], 50, [64] * 3, grad_bytes, gbps, latency, overlap=0.5)
    assert half.balanced.step_s == pytest.approx(0.1 + allreduce / 2)
    head = pred.headline()
    assert head["world_size"] == 3 and head["efficiency"] == pytest.approx(0.882, abs=1e-3)


def test_cost_model_pieces_by_hand():
    # 312 TFLOP/s x 0.35 / 67.8 GFLOP per sample = 1610.6 samples/s
    assert plan.datasheet_throughput(312, 0.35, 67.8e9) == pytest.approx(312e12 * 0.35 / 67.8e9)
    assert plan.ring_allreduce_s(1e9, 1, 100, 1e-5) == 0.0
    # 4 ranks, 400 MB, 100 Gbit/s = 12.5 GB/s: 1.5 * 0.032 s + 6 * 10 us
    assert plan.ring_allreduce_s(400e6, 4, 100, 1e-5) == pytest.approx(0.048 + 60e-6)
    # 16 GiB x 0.9, static 5 x 4 B x 100 M params = 2 GB, 100 MiB per sample
    cap = plan.memory_cap(16 * 2**30, 100_000_000, 100 * 2**20)
    assert cap == int((16 * 2**30 * 0.9 - 2e9) // (100 * 2**20)) == 128
    assert plan.memory_cap(16 * 2**30, 100_000_000, 100 * 2**20, limit=32) == 32
    assert plan.lookup_gpu("A100_80GB", "x").memory_gib == 80
    assert plan.lookup_gpu("rtx_a6000", "x").tensor_tflops == 154.8
    v100 = plan.lookup_gpu("v100", "x")
    # issue 10: auto = fp16 (shared loss scale) on Volta/Turing; fp32 only when asked for
    assert plan.runtime_precision(v100, "auto") == "fp16"  # bf16 needs capability >= 8.0
    assert plan.runtime_precision(v100, "fp32") == "fp32"
    assert plan.runtime_precision(v100, "auto", peak="tensor") == "fp16"
    assert plan.runtime_precision(plan.lookup_gpu("h100", "x"), "auto") == "bf16"
    with pytest.raises(ConfigError, match=r"k80.*a100"):
        plan.lookup_gpu("k80", "cluster.partitions.old.gpu_type")


def test_planner_options_are_stripped_and_checked():
    argv = [
        "cluster=mixed",
        "plan.mfu=0.5",
        "plan.link_gbps=200",
        "hydra.run.dir=x",
        "plan.overlap=0.25",
    ]
    assert plan.plan_overrides(argv) == [
        "cluster=mixed",
        "plan.mfu=0.5",
        "plan.link_gbps=200",
        "plan.overlap=0.25",
    ]
    opts = plan.compose_plan_run(argv).plan
    assert (opts.mfu, opts.link_gbps, opts.overlap) == (0.5, 200.0, 0.25)
    for bad in ("plan.mfu=0", "plan.mfu=abc", "plan.overlap=1.5", "plan.nope=1", "plan.probe="):
        with pytest.raises(ConfigError):
            plan.compose_plan_run([bad])


def test_campus64_bert_base_meets_the_targets(capsys):
    # in-process (the subprocess path is covered above); the model is built on the CPU
    code = plan.plan_command(
        ["cluster=campus64", "task=bert", "trainer.global_batch_size=65536", *BERT_BASE]
    )
    out = capsys.readouterr().out
    assert code == 0
    head = json.loads(out.strip().splitlines()[-1])
    assert head["world_size"] == 256
    assert head["speedup_vs_equal"] >= 1.5
    # with DDP's bucketed overlap (the default model) only the last bucket is exposed
    assert head["efficiency"] >= 0.9
    # the printed lower bound (nothing overlaps) stays below it: ~0.895 at 100 Gbit/s
    assert 0.8 < head["efficiency_no_overlap"] < head["efficiency"]


def test_ddp_overlap_by_hand():
    """Two equal ranks, 10 samples each at 100 samples/s: compute ends at 0.1 s, the last
    micro-batch's backward lasts 2/3 x 0.1 s = 66.7 ms."""
    from hetseq_hpc.balance.allocation import allocate

    split = allocate([100.0, 100.0], 20, [64, 64])
    # one bucket (1 MB of gradients): ready only at the end -> the whole 10 ms is exposed
    assert plan.ddp_exposed_allreduce_s(split, [100.0, 100.0], 0.010, 1e6) == pytest.approx(0.010)
    # 4 buckets of 25 MiB, 10 ms each, ready every 16.7 ms: each finishes before the next is
    # ready, so only the last bucket's 10 ms remains after compute
    grads = 4 * plan.DDP_BUCKET_BYTES
    assert plan.ddp_exposed_allreduce_s(split, [100.0, 100.0], 0.040, grads) == pytest.approx(0.010)
    # 4 buckets of 40 ms each: communication-bound; bucket 0 starts at 0.1 - 0.05 = 0.05 s and
    # the four run back to back until 0.05 + 0.16 = 0.21 s -> 0.11 s after compute
    assert plan.ddp_exposed_allreduce_s(split, [100.0, 100.0], 0.160, grads) == pytest.approx(0.110)


def test_plan_group_composes_for_every_command(tmp_path):
    """The ``plan`` group is part of the run config: ``python -m hetseq_hpc`` composes and
    validates ``plan.*`` too, records it in hetseq_config.yaml, and a saved config from before
    the group existed still loads (with the defaults)."""
    from omegaconf import OmegaConf

    from hetseq_hpc.config import load_run_config, save_run_config
    from hetseq_hpc.config.compose import compose_run_config

    run = compose_run_config(["task=bert"])
    assert run.plan == plan.PlanConfig()
    run = compose_run_config(["task=bert", "plan.overlap=0", "plan.peak=tensor"])
    assert (run.plan.overlap, run.plan.peak) == (0.0, "tensor")
    saved = save_run_config(run, tmp_path / "hetseq_config.yaml")
    assert load_run_config(saved).plan == run.plan
    old = OmegaConf.load(saved)
    del old["plan"]
    OmegaConf.save(old, tmp_path / "old.yaml")
    assert load_run_config(tmp_path / "old.yaml").plan == plan.PlanConfig()
    with pytest.raises(ConfigError, match=r"plan\.mfu"):
        compose_run_config(["task=bert", "plan.mfu=2"])


def test_small_batch_warning_names_a_batch_that_clears_the_bar():
    from hetseq_hpc.plan.planner import MIN_SAMPLES_PER_RANK, batch_warning

    def at(batch):  # two ranks at 100 samples/s, 1 MB of gradients over 1 Gbit/s links
        return plan.predict([100.0, 100.0], batch, [64, 64], 1e6, 1.0, overlap=0.0)

    assert batch_warning(at(64), at) is None
    line = batch_warning(at(4), at)  # 2 samples per rank, all-reduce 8 ms vs compute 20 ms
    assert "global batch 4 is small for 2 ranks" in line
    assert f"trainer.global_batch_size={2 * MIN_SAMPLES_PER_RANK}" in line
    assert "\n" not in line
    assert "plan fewer ranks" in batch_warning(at(4))  # no way to re-predict: no batch named


def test_planner_uses_the_task_flops_formula(tmp_path):
    """One FLOPs formula: the planner's figure is BertTask.flops_per_sample, which needs only
    the config (no data loaded, model on the meta device). An empty cache: nothing prepared, so
    the vocabulary is ``task.data.vocab_size`` (tests/unit/test_planned_vocab.py: after)."""
    import torch

    from hetseq_hpc.config.compose import compose_run_config
    from hetseq_hpc.tasks import build_task
    from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM

    run = compose_run_config(["task=bert", *BERT_BASE, f"task.data.cache_dir={tmp_path}"])
    with torch.device("meta"):
        model = BertMaskedLM(run.task.model, run.task.data.vocab_size)
    expected = build_task(run.task, seed=0).flops_per_sample(model)
    assert plan.measure_model(run.task, need_activations=False).flops_per_sample == expected
    assert expected == pytest.approx(67.822e9, rel=1e-4)  # the figure README prints
    # the spec model's memory traffic is counted from the same config (12 x 768, 12 heads, T 128),
    # with the fused attention the task's encoder runs on a GPU (no heads x T x T scores written)
    from hetseq_hpc.plan.perf_model import transformer_accesses

    info = plan.measure_model(run.task, need_activations=False)
    assert info.accesses_per_sample == transformer_accesses(
        12, 768, 12, 128, 3072, fused_attention=True
    )
    assert info.accesses_per_sample < transformer_accesses(12, 768, 12, 128, 3072)


def test_bert_attention_is_the_fused_kernel_the_planner_counts(monkeypatch):
    """The planner counts hetseq_hpc's BERT with fused attention (perf_model.transformer_accesses
    ``fused_attention=True``) because its encoder calls ``scaled_dot_product_attention``, which
    on a GPU runs FlashAttention or memory-efficient attention and never writes the scores. If the
    encoder goes back to eager attention, this fails, and the count must follow it."""
    import torch
    import torch.nn.functional as F

    from hetseq_hpc.config.compose import compose_run_config
    from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM

    run = compose_run_config(["task=bert"])
    model = BertMaskedLM(run.task.model, run.task.data.vocab_size).train()
    calls = []
    sdpa = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(kwargs.get("dropout_p", 0.0))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    ids = torch.randint(0, run.task.data.vocab_size, (2, run.task.model.max_seq_len))
    with torch.no_grad():
        model(ids, ids)
    assert len(calls) == run.task.model.num_layers  # one fused call per layer, dropout inside it
    assert all(p == run.task.model.dropout for p in calls)


def test_local_plan_from_a_probe_file(tmp_path, capsys):
    """cluster=local with plan.probe (as scripts/bench_hetero.py runs it): rank i takes probe
    rank i; 60 and 30 samples/s split a batch of 30 as 20 + 10."""
    probe = tmp_path / "probe.json"
    probe.write_text(
        json.dumps(
            {
                "ranks": [
                    {
                        "rank": r,
                        "device": f"cpu @{s}",
                        "calibration": {"samples_per_s": t, "max_micro_batch": 16},
                    }
                    for r, (s, t) in enumerate(((1.0, 60.0), (0.5, 30.0)))
                ]
            }
        )
    )
    code = plan.plan_command(
        [
            "cluster.ranks=2",
            "cluster.speeds=[1.0,0.5]",
            "trainer.global_batch_size=30",
            "balance.max_micro_batch=16",
            f"plan.probe={probe}",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "cpu @0.5 (probe)" in out
    head = json.loads(out.strip().splitlines()[-1])
    assert head["world_size"] == 2 and head["ideal_samples_per_s"] == 90.0
    assert "is small for 2 ranks" not in err  # 15 samples per rank


def test_local_plan_calibrates_this_cpu_as_a_rank_would():
    """cluster=local without a probe: the small model is timed on this CPU with the runtime's
    placement (threads, calibration micro-batch, memory budget), x cluster.speeds."""
    from hetseq_hpc.balance.placement import calibration_micro_batch, plan_placements

    run = plan.compose_plan_run(
        [
            "cluster.ranks=2",
            "cluster.speeds=[1.0,0.5]",
            "trainer.global_batch_size=24",
            "balance.calibration_steps=1",
            *SMALL_MODEL,
        ]
    )
    result = plan.make_plan(run)
    threads = plan_placements(run)[0].threads
    assert [r.device for r in result.ranks] == [f"cpu {threads} thr", f"cpu {threads} thr @0.5"]
    fast, slow = (r.samples_per_s for r in result.ranks)
    assert fast > 0 and slow == pytest.approx(fast / 2)
    assert result.source.endswith(
        f"at {threads} thread(s), micro-batch {calibration_micro_batch(run, 2)}, x cluster.speeds"
    )
    assert result.prediction.balanced.allocation.samples == [16, 8]
    assert f"cpu {threads} thr @0.5" in plan.render(result)


def test_prediction_with_cost_curves_by_hand():
    """The runtime's cost model in the planner: T_i = ceil(b/32) a + c b + f, no all-reduce."""
    from hetseq_hpc.balance.curves import CostCurve

    curves = [CostCurve(0.02, 0.01, 0.05), CostCurve(0.1, 0.03, 0.1)]
    pred = plan.predict([1.0, 1.0], 64, [32, 32], 0.0, 10.0, 0.0, overlap=0.0, curves=curves)
    # 51 + 13: fast 2 x 0.02 + 0.51 + 0.05 = 0.60 s, slow 0.1 + 0.39 + 0.1 = 0.59 s
    # (50 + 14 -> 0.62 s on the slow rank, 52 + 12 -> 0.61 s on the fast one)
    assert pred.balanced.allocation.samples == [51, 13]
    assert pred.balanced.compute_s == pytest.approx((0.60, 0.59))
    assert pred.balanced.step_s == pytest.approx(0.60)
    # equal split: the slow rank runs 32 samples in 1.16 s
    assert pred.equal.step_s == pytest.approx(1.16)
    # ideal: each rank alone on the whole batch: 64 / 0.73 + 64 / 2.22
    assert pred.ideal_samples_per_s == pytest.approx(64 / 0.73 + 64 / 2.22)
    assert pred.efficiency == pytest.approx(64 / 0.60 / (64 / 0.73 + 64 / 2.22))


def test_probe_cost_curves_prefer_the_latest_fit(tmp_path):
    from hetseq_hpc.balance.curves import CostCurve

    probe = _probe(("a", "a100", 300.0), ("b", "t4", 100.0))
    probe["ranks"][0]["calibration"].update(overhead_s=0.01, per_sample_s=0.003, step_fixed_s=0.02)
    parts = [plan.PartitionSpec("a", "a", "a100", 1), plan.PartitionSpec("b", "b", "t4", 1)]
    # rank 1 has no fit: no curves for the plan (samples/s are used)
    ranks = plan.ranks_from_probe(probe, parts)
    assert ranks[0].curve == CostCurve(0.01, 0.003, 0.02) and ranks[1].curve is None
    probe["fitted_curves"] = [CostCurve(0.0, 0.004).to_dict(), CostCurve(0.0, 0.01).to_dict()]
    ranks = plan.ranks_from_probe(probe, parts)
    assert [r.curve.per_sample_s for r in ranks] == [0.004, 0.01]


def test_a_probe_runs_measured_step_sync_replaces_the_all_reduce_model(tmp_path, capsys):
    """A probe of the same world with ``measured_step.sync_s`` (written by a finished run):
    the predicted step is max busy + that figure; a probe of another world size keeps the
    all-reduce model."""
    probe = tmp_path / "probe.json"
    data = {
        "ranks": [
            {
                "rank": r,
                "device": f"cpu @{s}",
                "calibration": {"samples_per_s": t, "max_micro_batch": 16},
            }
            for r, (s, t) in enumerate(((1.0, 60.0), (0.5, 30.0)))
        ],
        "measured_step": {"steps": 20, "sync_s": 0.05},
    }
    probe.write_text(json.dumps(data))
    args = [
        "cluster.speeds=[1.0,0.5]",
        "trainer.global_batch_size=30",
        "balance.max_micro_batch=16",
        f"plan.probe={probe}",
    ]
    assert plan.plan_command(["cluster.ranks=2", *args]) == 0
    out = capsys.readouterr().out
    head = json.loads(out.strip().splitlines()[-1])
    # 20 + 10 samples at 60 and 30 samples/s: 1/3 s busy on both ranks, + 0.05 s measured
    assert head["sync_measured"] is True
    assert head["step_time_s"] == pytest.approx(1 / 3 + 0.05, abs=1e-6)
    assert "the probe run measured 50 ms per step" in out
    assert plan.probe_sync_s(data, 3) is None and plan.probe_sync_s(data, 2) == 0.05
    data.pop("measured_step")
    assert plan.probe_sync_s(data, 2) is None


def test_a_probe_of_one_partition_of_three_plans_the_mix(tmp_path, capsys):
    """plan.probe with only the a100 partition measured: a100 ranks use the probe; v100 and t4
    come from the GPU spec model scaled by the a100 measured / predicted ratio, and the plan
    says which partitions came from where."""
    from hetseq_hpc.config import compose_run_config
    from hetseq_hpc.plan.planner import make_plan

    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(_probe(("a100", "a100", 400.0))))
    overrides = ["cluster=mixed", *SMALL_MODEL, "trainer.global_batch_size=256"]
    table = make_plan(compose_run_config(overrides))
    partial = make_plan(compose_run_config([*overrides, f"plan.probe={probe}"]))
    by_part = {}
    for r in partial.ranks:
        by_part.setdefault(r.partition, r)
    assert by_part["a100"].samples_per_s == 400.0 and "(probe)" in by_part["a100"].device
    scale = 400.0 / next(r for r in table.ranks if r.partition == "a100").samples_per_s
    for key in ("v100", "t4"):
        from_table = next(r for r in table.ranks if r.partition == key).samples_per_s
        assert by_part[key].samples_per_s == pytest.approx(from_table * scale)
        assert f"x{scale:.2f}" in by_part[key].device
    assert [r.rank for r in partial.ranks] == list(range(len(partial.ranks)))
    assert "for partition(s) a100; v100, t4 from GPU specs" in partial.source


def test_a_probe_that_matches_no_partition_or_misses_a_cpu_one_is_refused(tmp_path):
    from hetseq_hpc.config import compose_run_config
    from hetseq_hpc.plan.planner import make_plan

    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(_probe(("elsewhere", "h100", 400.0))))
    with pytest.raises(ConfigError, match="has no rank of partition"):
        make_plan(compose_run_config(["cluster=mixed", *SMALL_MODEL, f"plan.probe={probe}"]))
    probe.write_text(json.dumps(_probe(("a100", "a100", 400.0))))
    cpu = "+cluster.partitions.cpus={partition: cpus, nodes: 1}"
    with pytest.raises(ConfigError, match="CPU-only partition"):
        make_plan(compose_run_config(["cluster=mixed", cpu, *SMALL_MODEL, f"plan.probe={probe}"]))


def test_a_partition_can_set_its_own_intra_node_link():
    """``cluster.partitions.NAME.intra_node_gbps`` overrides the GPU's spec row for the ring's
    links inside a node (a PCIe switch slower than the spec's, NVLink the spec lacks); the
    value is validated like the other partition fields."""
    from hetseq_hpc.config.compose import compose_run_config
    from hetseq_hpc.plan.planner import intra_node_gbps, ring_gbps_of

    base = ["task=bert", "cluster=mixed"]
    run = compose_run_config(base)
    names = list(run.cluster.partitions)
    slow = [f"cluster.partitions.{n}.intra_node_gbps=1" for n in names]
    assert ring_gbps_of(compose_run_config([*base, *slow]), 1000.0) == pytest.approx(1.0)
    default = ring_gbps_of(run, 1000.0)
    specs = [
        intra_node_gbps(p.gpu_type)
        for p in run.cluster.partitions.values()
        if p.ranks_per_node_effective > 1
    ]
    assert default == pytest.approx(min([*specs, 1000.0]))
    with pytest.raises(ConfigError, match=rf"cluster\.partitions\.{names[0]}\.intra_node_gbps"):
        compose_run_config([*base, f"cluster.partitions.{names[0]}.intra_node_gbps=0"])


def test_spec_ranks_pay_a_fixed_time_per_micro_batch():
    """Ranks from the GPU spec model carry a cost curve: the per-sample time of the spec rate
    plus the pass's fixed time for this model's parameter tensors, so a plan that needs more
    gradient-accumulation passes predicts a longer step (docs/planner-accuracy.md)."""
    from hetseq_hpc.config import compose_run_config
    from hetseq_hpc.plan.perf_model import pass_overhead_s
    from hetseq_hpc.plan.planner import make_plan

    base = [
        "cluster=hetseq_seed",
        "~cluster.partitions.p100",
        "cluster.partitions.xp.nodes=1",
        *SMALL_MODEL,
        "trainer.global_batch_size=256",
    ]
    one_pass = make_plan(compose_run_config([*base, "balance.max_micro_batch=64"]))
    many = make_plan(compose_run_config([*base, "balance.max_micro_batch=8"]))
    rank = one_pass.ranks[0]
    assert rank.curve is not None and rank.curve.overhead_s > 0
    assert rank.curve.overhead_s == pytest.approx(pass_overhead_s(one_pass.model.param_tensors))
    assert rank.curve.per_sample_s == pytest.approx(1 / rank.samples_per_s)
    assert "ms per micro-batch" in one_pass.source
    shares = many.prediction.balanced.allocation.shares
    assert (
        shares[0].accum_steps == 8
        and one_pass.prediction.balanced.allocation.shares[0].accum_steps == 1
    )
    extra = many.prediction.balanced.step_s - one_pass.prediction.balanced.step_s
    assert extra == pytest.approx(7 * rank.curve.overhead_s, rel=1e-6)


def test_a_partial_probe_scales_the_spec_model_by_per_sample_rates(tmp_path):
    """With a cost curve in the probe, the scale compares its per-sample rate (1 / c) with the
    spec model's, not its samples/s at the calibration's micro-batch (which includes the fixed
    time per pass the spec ranks charge again)."""
    from hetseq_hpc.config import compose_run_config
    from hetseq_hpc.plan.planner import make_plan

    data = _probe(("a100", "a100", 400.0))
    data["ranks"][0]["calibration"].update(overhead_s=0.01, per_sample_s=1 / 500.0)
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(data))
    overrides = ["cluster=mixed", *SMALL_MODEL, "trainer.global_batch_size=256"]
    table = make_plan(compose_run_config(overrides))
    partial = make_plan(compose_run_config([*overrides, f"plan.probe={probe}"]))
    scale = 500.0 / next(r for r in table.ranks if r.partition == "a100").samples_per_s
    v100 = next(r for r in partial.ranks if r.partition == "v100")
    spec_v100 = next(r for r in table.ranks if r.partition == "v100")
    assert v100.samples_per_s == pytest.approx(spec_v100.samples_per_s * scale)
    assert v100.curve.per_sample_s == pytest.approx(spec_v100.curve.per_sample_s / scale)
    assert v100.curve.overhead_s == spec_v100.curve.overhead_s > 0


def test_the_spec_plan_says_the_requested_precision_and_each_rank_s():
    """``precision=fp32`` is planned in fp32 on every GPU, and the source line says fp32 was
    requested (it described only what ``auto`` picks)."""
    from hetseq_hpc.config import compose_run_config
    from hetseq_hpc.plan.planner import make_plan

    result = make_plan(compose_run_config(["cluster=mixed", *SMALL_MODEL, "precision=fp32"]))
    assert "from the requested fp32 (auto:" in result.source, result.source
    assert all(" fp32 (specs" in r.device for r in result.ranks), [r.device for r in result.ranks]
    auto = make_plan(compose_run_config(["cluster=mixed", *SMALL_MODEL]))
    assert "from the requested auto (auto:" in auto.source
    assert any(" bf16 (specs" in r.device for r in auto.ranks)


def test_the_plan_names_the_cluster_config_not_its_kind(capsys):
    """cluster=mixed is a Slurm cluster (cluster.name=slurm), but the plan is of the config
    the user named."""
    from hetseq_hpc.config.compose import group_choices

    assert group_choices([])["cluster"] == "local"
    assert group_choices(["cluster=testcluster", "task=hf"])["cluster"] == "testcluster"
    code = plan.plan_command(["cluster=mixed", "trainer.global_batch_size=4096", *SMALL_MODEL])
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[0].startswith("hetseq_hpc plan: cluster=mixed, 16 ranks"), out
