"""Sharded data parallelism's pieces, in-process (hetseq_hpc.train.parallel, balance.memory,
tasks.base.default_sharding_units). The 2- and 3-rank FSDP runs of every task are in
tests/integration/test_sharding_exact.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hetseq_hpc.balance.memory import (
    STATIC_PARAM_COPIES,
    memory_cap,
    model_bytes,
    model_state_bytes,
    replica_fits,
)
from hetseq_hpc.config import compose_run_config
from hetseq_hpc.distributed.rendezvous import single_process_rendezvous
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.tasks.base import default_sharding_units
from hetseq_hpc.train.parallel import Replicated, Sharded, equal_pass_sizes
from tests.helpers.nets import TwoBlockNet


@pytest.mark.parametrize(
    "samples, passes, expected",
    [
        (24, 5, ([5, 5, 5, 5, 4], 0)),  # more passes than its own split: smaller micro-batches
        (8, 5, ([2, 2, 2, 1, 1], 0)),
        (3, 5, ([1, 1, 1], 2)),  # fewer samples than passes: two zero-weight passes
        (7, 1, ([7], 0)),
    ],
)
def test_every_rank_runs_the_jobs_largest_number_of_passes(samples, passes, expected):
    sizes, padding = equal_pass_sizes(samples, passes)
    assert (sizes, padding) == expected and sum(sizes) == samples
    assert len(sizes) + padding == passes


def test_default_units_are_the_blocks_of_the_builtin_models():
    from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM
    from hetseq_hpc.tasks.image.resnet import BasicBlock, ResNetClassifier
    from hetseq_hpc.tasks.translation.transformer import TranslationTransformer

    run = compose_run_config(["task.model.num_layers=3"])
    bert = BertMaskedLM(run.task.model, 100)
    units = default_sharding_units(bert)
    assert len(units) == 3 and all(type(u).__name__ == "BertLayer" for u in units)
    image = compose_run_config(
        ["task=image", "task.model.num_stages=2", "task.model.blocks_per_stage=2"]
    ).task.model
    units = default_sharding_units(ResNetClassifier(image, 3, 10))
    assert len(units) == 4 and all(isinstance(u, BasicBlock) for u in units)
    cfg = compose_run_config(
        ["task=translation", "task.model.num_encoder_layers=2", "task.model.num_decoder_layers=3"]
    ).task.model
    units = default_sharding_units(TranslationTransformer(cfg, 50))
    assert [type(u).__name__ for u in units].count("TransformerDecoderLayer") == 3
    assert len(units) == 5
    assert default_sharding_units(nn.Linear(4, 4)) == []


def test_model_state_bytes_replicated_and_sharded():
    p = 4e9  # a 1 B-parameter model in fp32
    assert model_state_bytes(p) == STATIC_PARAM_COPIES * p
    # the shard, plus the whole weights gathered for validation (more than 2 x root + 3 blocks)
    assert model_state_bytes(p, "fsdp", 8, 1e8, root_bytes=1e8) == 4 * p / 8 + p
    assert model_state_bytes(p, "fsdp", 8, 1e8, offload=True, root_bytes=1e8) == p
    # validation on the shards: FSDP2's peak in training, the root (kept gathered through
    # forward and backward) and its gradient, a block, its gradient and the next one prefetched
    assert model_state_bytes(
        p, "fsdp", 8, 1e8, gathered_weights=False, root_bytes=2e8
    ) == pytest.approx(4 * p / 8 + 2 * 2e8 + 3 * 1e8)
    # a model whose root unit (embeddings) is most of it: 2 x that unit, 3 x its block
    assert model_state_bytes(p, "fsdp", 8, 0.1 * p, root_bytes=0.8 * p) == pytest.approx(
        4 * p / 8 + 1.6 * p + 0.3 * p
    )
    # never more than every weight and gradient whole; no unit: the root is the whole model
    assert model_state_bytes(p, "fsdp", 8, 0.5 * p, root_bytes=0.5 * p) == 4 * p / 8 + 2 * p
    assert model_state_bytes(p, "fsdp", 8, 0.0, root_bytes=p) == 4 * p / 8 + 2 * p
    # root not known: everything outside the largest block (an upper bound)
    assert model_state_bytes(p, "fsdp", 8, 0.1 * p, gathered_weights=False) == pytest.approx(
        4 * p / 8 + 2 * p
    )
    # a 16 GiB T4 cannot hold the replica, a shard over 8 ranks leaves room for activations
    t4 = 16 * 2**30
    assert not replica_fits(t4, p)
    assert memory_cap(t4, p, 2**26) == 0
    assert (
        memory_cap(t4, p, 2**26, static_bytes=model_state_bytes(p, "fsdp", 8, 1e8, root_bytes=1e8))
        > 50
    )


def test_model_bytes_root_and_largest_block_match_the_size_formulas():
    """The runtime reads the root unit and the largest block from the built model
    (:func:`model_bytes`); the pre-flight check computes them from the configuration alone
    (:func:`unit_param_counts`): the same figures for BERT and translation."""
    from hetseq_hpc.tasks import build_task
    from hetseq_hpc.tasks.bert.mlm_model import BertMaskedLM
    from hetseq_hpc.tasks.sizes import unit_param_counts
    from hetseq_hpc.tasks.translation.transformer import TranslationTransformer

    run = compose_run_config(
        [
            "task.model.num_layers=3",
            "task.model.hidden_size=32",
            "task.model.num_heads=2",
            "task.model.intermediate_size=64",
        ]
    )
    with torch.device("meta"):
        bert = BertMaskedLM(run.task.model, run.task.data.vocab_size)
    sizes = model_bytes(build_task(run.task, 0), bert)
    root, block = unit_param_counts(run.task)
    assert (sizes.root, sizes.block) == (4.0 * root, 4.0 * block)
    assert sizes.total == sum(4.0 * p.numel() for p in bert.parameters())
    tr = compose_run_config(
        [
            "task=translation",
            "task.model.num_encoder_layers=2",
            "task.model.num_decoder_layers=1",
            "task.model.d_model=32",
            "task.model.ff_size=64",
            "task.model.num_heads=2",
        ]
    ).task
    with torch.device("meta"):
        model = TranslationTransformer(tr.model, tr.data.vocab_size)

    class Units:  # the translation task's units are the default ones
        sharding_units = staticmethod(default_sharding_units)

    sizes = model_bytes(Units(), model)
    root, block = unit_param_counts(tr)
    assert (sizes.root, sizes.block) == (4.0 * root, 4.0 * block)
    assert model_bytes(object(), nn.Linear(3, 2)) == (32.0, 32.0, 0.0)  # no units: all root


def test_sharding_config_values_and_old_keys():
    assert compose_run_config(["sharding=fsdp"]).sharding.mode == "fsdp"
    run = compose_run_config(["trainer.sharding=auto", "trainer.activation_checkpointing=true"])
    assert run.sharding.mode == "auto" and run.sharding.activation_checkpointing
    with pytest.raises(ConfigError, match=r"sharding\.mode='zero3' is unknown"):
        compose_run_config(["sharding.mode=zero3"])
    with pytest.raises(ConfigError, match=r"comm\.grad_combine=adasum are DDP hooks"):
        compose_run_config(["sharding.mode=fsdp", "comm.grad_combine=adasum", "cluster.ranks=2"])


_Net = TwoBlockNet


def test_sharded_checkpoint_state_has_the_replicated_layout_on_one_rank():
    """The full model and optimizer state an FSDP run saves is laid out exactly as DDP's
    (parameters numbered in param_groups order), so checkpoints move between the modes."""
    torch.manual_seed(0)
    plain, sharded = _Net(), _Net()
    sharded.load_state_dict(plain.state_dict())
    x = torch.randn(6, 4)
    with single_process_rendezvous() as rdv:
        assert rdv.world.world_size == 1
        replica = Replicated(plain, torch.device("cpu"))
        shard = Sharded(sharded, list(sharded.blocks), torch.device("cpu"))
        states = []
        for strategy, model in ((replica, plain), (shard, sharded)):
            opt = torch.optim.AdamW(
                [
                    {"params": list(model.parameters())[:2]},
                    {"params": list(model.parameters())[2:], "lr": 0.5},
                ]
            )
            model(x).backward()
            opt.step()
            states.append((strategy.model_state(), strategy.optimizer_state(opt)))
        (m1, o1), (m2, o2) = states
        assert list(m1) == list(m2)
        assert all(torch.allclose(m1[k], m2[k].cpu(), atol=1e-6) for k in m1)
        assert o1["param_groups"] == o2["param_groups"]
        assert sorted(o1["state"]) == sorted(o2["state"])
        for i in o1["state"]:
            assert torch.allclose(o1["state"][i]["exp_avg"], o2["state"][i]["exp_avg"], atol=1e-6)
        # and back: the DDP-layout state loads into the sharded model and its optimizer
        opt = torch.optim.AdamW(
            [
                {"params": list(sharded.parameters())[:2]},
                {"params": list(sharded.parameters())[2:], "lr": 0.5},
            ]
        )
        shard.load_model_state(m1)
        shard.load_optimizer_state(opt, o1)
        back = shard.optimizer_state(opt)
        assert [(g["params"], g["lr"], list(g["betas"])) for g in back["param_groups"]] == [
            (g["params"], g["lr"], list(g["betas"])) for g in o1["param_groups"]
        ]
        assert torch.allclose(back["state"][4]["exp_avg_sq"], o1["state"][4]["exp_avg_sq"])


def test_planner_modes_for_a_mix_with_a_small_gpu():
    """4 x 16 GiB + 4 x 80 GiB: a 1.3 B-parameter model (BERT-large-like units of 1/24) does
    not fit the 16 GiB ranks as a replica but fits sharded. With K passes FSDP moves 3K/2
    all-reduces resharded between them (2K all-gathers, K reduce-scatters, each half of one) and
    (K+1)/2 kept gathered (one all-gather), which holds the whole weights (5.2 GB: they fit
    16 GiB beside the shard)."""
    from hetseq_hpc.plan.sharding_plan import chosen_mode, fsdp_traffic_factor, mode_fits

    memory = [16 * 2**30] * 4 + [80 * 2**30] * 4
    ddp, fsdp, kept = mode_fits(
        memory, 1_300_000_000, 1_300_000_000 // 24, 2**28, ddp_step_s=1.0, allreduce_s=0.2, passes=2
    )
    assert (ddp.mode, ddp.fits, fsdp.mode, fsdp.fits) == ("ddp", False, "fsdp", True)
    assert (kept.mode, kept.fits) == ("fsdp-kept", True)
    # validation gathers the whole weights anyway (the default): holding them between passes
    # costs nothing more at the peak; where validation runs on the shards, it does
    assert kept.state_bytes == fsdp.state_bytes
    assert ddp.largest_params < 1_300_000_000 < fsdp.largest_params
    _, sharded, sharded_kept = mode_fits(
        memory,
        1_300_000_000,
        1_300_000_000 // 24,
        2**28,
        1.0,
        0.2,
        passes=2,
        gathered_weights=False,
        root_params=1_300_000_000 // 24,
    )
    assert sharded_kept.state_bytes > sharded.state_bytes
    assert sharded_kept.largest_params < sharded.largest_params
    assert fsdp.step_s == pytest.approx(1.0 + (3.0 - 1) * 0.2)
    assert kept.step_s == pytest.approx(1.0 + (1.5 - 1) * 0.2)
    assert [fsdp_traffic_factor(k) for k in (1, 2, 4)] == [1.5, 3.0, 6.0]
    # kept gathered, a step of one pass all-gathers once (its backward gathers nothing)
    assert [fsdp_traffic_factor(k, keep_gathered=True) for k in (1, 2, 4)] == [1.0, 1.5, 2.5]
    assert [f.mode for f in mode_fits(memory, 10**8, 10**7, 2**20, 1.0, 0.2, passes=1)] == [
        "ddp",
        "fsdp",
        "fsdp-kept",
    ]
    assert chosen_mode("auto", memory, 1_300_000_000) == "fsdp"
    assert chosen_mode("auto", memory, 100_000_000) == "ddp"
    assert chosen_mode("none", memory, 1_300_000_000) == "ddp"


SMALL_BERT = [
    "task.model.hidden_size=64",
    "task.model.num_layers=2",
    "task.model.num_heads=2",
    "task.model.intermediate_size=128",
    "task.model.max_seq_len=64",
]


def test_plan_of_a_local_mix_too_small_for_a_replica_picks_and_shows_fsdp(tmp_path):
    from hetseq_hpc.plan.planner import make_plan
    from hetseq_hpc.plan.render import headline_json, render

    # nothing prepared (an empty cache), so the planner builds BERT with the configured
    # vocabulary (8192): the root unit (embeddings) is most of this small model (2.2 of 2.4 MB),
    # kept gathered with its gradient, so a shard needs ~9.6 MB of the 13 MiB budget; a
    # replica 12.2 MB, with no room for activations
    run = compose_run_config(
        [
            f"task.data.cache_dir={tmp_path}",
            "cluster.ranks=2",
            "cluster.memory_budget_gb=0.013",
            "sharding.mode=auto",
            "task.model.hidden_size=64",
            "task.model.num_layers=2",
            "task.model.num_heads=2",
            "task.model.intermediate_size=128",
            "task.model.max_seq_len=64",
        ]
    )
    plan = make_plan(run)
    assert plan.sharding == "fsdp"
    fits = {f.mode: f for f in plan.mode_fits}
    assert not fits["ddp"].fits and fits["fsdp"].fits
    assert all(r.max_micro_batch >= 1 for r in plan.ranks)  # the sharded caps
    text = render(plan)
    assert "sharding (sharding.mode=auto -> fsdp)" in text and "largest model" in text
    import json

    assert json.loads(headline_json(plan))["modes"]["fsdp"]["fits"] is True


def test_the_planner_groups_the_units_as_the_runtime_does(tmp_path):
    """The planner's FSDP block is the runtime's (agree_on_units): the units as ONE group for
    ``sharding.units=one`` and for ``auto`` where a replica fits every rank (the whole weights
    outside the root gathered at once), the largest unit for ``per_unit`` or where a replica
    does not fit; the largest model that fits is scaled from per-unit sharding unless ``one``."""
    from hetseq_hpc.plan.planner import make_plan
    from hetseq_hpc.plan.sharding_plan import mode_fits, planned_block_params

    big, small = [80 * 2**30] * 2, [2**20] * 2
    args = (10**8, 10**7, 2 * 10**7)  # parameters, largest unit, root
    assert planned_block_params("per_unit", big, *args) == 10**7
    assert planned_block_params("one", small, *args) == 8 * 10**7
    assert planned_block_params("auto", big, *args) == 8 * 10**7  # a replica fits
    assert planned_block_params("auto", small, *args) == 10**7
    assert planned_block_params("one", big, 10**8, 10**7, None) == 10**7  # root unknown

    def fsdp(units: str):
        run = compose_run_config(
            [
                f"task.data.cache_dir={tmp_path}",
                "cluster.ranks=2",
                "sharding.mode=fsdp",
                f"sharding.units={units}",
                *SMALL_BERT,
            ]
        )
        return {f.mode: f for f in make_plan(run).mode_fits}["fsdp"]

    per_unit, grouped, auto = fsdp("per_unit"), fsdp("one"), fsdp("auto")
    assert grouped.state_bytes > per_unit.state_bytes  # both layers gathered at once
    assert auto.state_bytes == grouped.state_bytes  # a replica fits this host: grouped
    # the largest model: scaled per unit unless `one` (a model too big for a replica is
    # sharded unit by unit under `auto`)
    memory = [2**30] * 2

    def largest(block: int, scaled: int) -> int:
        fits = mode_fits(memory, 10**8, block, 2**20, 1.0, 0.2, 1, root_params=2 * 10**7,
                         scaled_unit_params=scaled)  # fmt: skip
        return fits[1].largest_params

    assert largest(8 * 10**7, 10**7) == largest(10**7, 10**7) > largest(8 * 10**7, 8 * 10**7)


def test_preflight_counts_the_whole_weights_only_where_the_task_decodes(task_data_files):
    """The pre-flight check asks the task's own rule (Task.evaluates_in_fixed_passes), as the
    runtime and the planner do: translation without BLEU validates on the shards and is not
    refused for the whole weights it would never gather; with BLEU (greedy decoding) it is."""
    from hetseq_hpc.balance.memory import PARAM_BYTES
    from hetseq_hpc.cli.preflight import check_model_fits, evaluates_in_fixed_passes
    from hetseq_hpc.tasks.sizes import param_count, unit_param_counts
    from tests.helpers.tasks import task_overrides

    task = [
        *task_overrides("translation", task_data_files),
        "task.model.num_encoder_layers=4",
        "task.model.num_decoder_layers=4",
    ]
    base = compose_run_config([*task, "cluster.ranks=2", "sharding.mode=fsdp"])
    count = param_count(base.task)
    root, block = unit_param_counts(base.task)
    args = (count * PARAM_BYTES, "fsdp", 2, block * PARAM_BYTES)
    on_shards = model_state_bytes(*args, gathered_weights=False, root_bytes=root * PARAM_BYTES)
    whole = model_state_bytes(*args, gathered_weights=True, root_bytes=root * PARAM_BYTES)
    assert on_shards < whole  # this shape gathers less in training than the whole weights
    budget = f"cluster.memory_budget_gb={(on_shards + whole) / 2 / 2**30:.9f}"
    fixed = compose_run_config(
        [*task, "cluster.ranks=2", "sharding.mode=fsdp", budget, "task.data.bleu_samples=0"]
    )
    assert evaluates_in_fixed_passes(fixed.task)
    check_model_fits(fixed)  # fits: validation runs on the shards
    decoding = compose_run_config([*task, "cluster.ranks=2", "sharding.mode=fsdp", budget])
    assert not evaluates_in_fixed_passes(decoding.task)
    with pytest.raises(ConfigError, match="the whole weights gathered for validation"):
        check_model_fits(decoding)


def test_per_rank_budgets_place_each_rank_and_the_preflight_names_the_small_one():
    from hetseq_hpc.balance.placement import plan_placements
    from hetseq_hpc.cli.preflight import check_model_fits, rank_memory_limits

    small = [
        "task.model.hidden_size=64",
        "task.model.num_layers=2",
        "task.model.num_heads=2",
        "task.model.intermediate_size=128",
        "task.model.max_seq_len=64",
    ]
    run = compose_run_config([*small, "cluster.ranks=2", "cluster.memory_budgets_gb=[0.008,4]"])
    assert [p.memory_budget_gb for p in plan_placements(run, cores=2)] == [0.008, 4.0]
    assert [w for w, *_ in rank_memory_limits(run)] == ["rank 0", "rank 1"]
    with pytest.raises(ConfigError, match=r"rank 0 may use .*memory_budgets_gb\[0\]=0.008"):
        check_model_fits(run)  # DDP: a replica does not fit the small rank
    check_model_fits(
        compose_run_config(
            [*small, "cluster.ranks=2", "sharding.mode=fsdp", "cluster.memory_budgets_gb=[0.02,4]"]
        )
    )


def test_memory_watch_measures_the_growth_from_the_placed_model(caplog):
    """On the CPU the watch measures the resident set's growth over its baseline, with the
    peak reset when the window begins: what was freed before it does not count."""
    import logging

    from hetseq_hpc.balance.peak import MemoryWatch

    watch = MemoryWatch(torch.device("cpu"), 2**30).begin()
    before = torch.ones(50 * 2**20)  # 200 MiB, freed before the window
    del before
    watch.start_window()
    kept = torch.ones(10 * 2**20)  # 40 MiB in the window
    with caplog.at_level(logging.INFO, logger="hetseq_hpc.balance.peak"):
        report = watch.report(3)
    assert kept.numel() == 10 * 2**20
    assert 40 * 2**20 <= report["measured_peak_bytes"] < 150 * 2**20, report
    assert report["budget_bytes"] == 2**30 and report["peak_measure"] == "rss_growth"
    assert (
        "rank 3 memory: measured peak" in caplog.text and "of its budget 1024.00 MiB" in caplog.text
    )


def test_running_peak_takes_off_a_block_whose_free_was_missed_when_its_address_returns():
    """The profiler misses frees made on threads it does not profile: a block whose address is
    handed out again was freed by then, so it stops counting; frees of blocks allocated before
    the window lower the sum as they always did."""
    from hetseq_hpc.balance.peak import running_peak

    # 100 at A, 50 at B, B freed, A's free missed, 100 at A again (A was freed), 30 at C
    events = [(1, 0xA, 100), (2, 0xB, 50), (3, 0xB, -50), (4, 0xA, 100), (5, 0xC, 30)]
    assert running_peak(events) == 150  # a plain running sum would say 230
    # a free of a block from before the window, then a new block
    assert running_peak([(1, 0xD, -40), (2, 0xE, 60)]) == 20
    assert running_peak([]) == 0


def test_cpu_allocations_see_a_real_tensors_bytes():
    """torch's profiler records a real allocation on this thread (no model, no ranks)."""
    from hetseq_hpc.balance.peak import CpuAllocations

    watch = CpuAllocations(steps=1000)
    kept = torch.zeros(256, 1024)  # 1 MiB, alive at the peak
    del kept
    peak = watch.stop()
    assert 2**20 <= peak < 4 * 2**20, peak


def test_the_fsdp_check_trusts_the_pinned_torch_and_imports_an_older_one(monkeypatch):
    """check_fsdp_available reads torch's version from its package metadata (the launcher then
    never imports torch, ~3 CPU-s per command); a torch older than the pinned one is imported
    and its FSDP2 looked at, and one lacking the sum reductions is refused in one line."""
    from torch.distributed.fsdp import FSDPModule

    from hetseq_hpc.config import validate

    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert validate.installed_torch_version() == (major, minor)
    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    monkeypatch.setattr(validate, "installed_torch_version", lambda: (2, 13))
    validate.check_fsdp_available("fsdp")  # trusted by version: FSDPModule not looked at
    monkeypatch.setattr(validate, "installed_torch_version", lambda: (2, 6))
    with pytest.raises(ConfigError, match=r"sharding.mode=auto needs PyTorch's FSDP2 .*"):
        validate.check_fsdp_available("auto")
