"""``trainer.compile`` without compiling anything (the compiled runs are in
tests/integration/test_compile_exact.py): which devices compile, the one-line refusal of a bad
value, the first step's extra collective timeout, and the re-balancer leaving a compiling step
alone."""

from __future__ import annotations

import pytest
import torch

from hetseq_hpc.balance.allocation import allocate
from hetseq_hpc.balance.rebalance import Rebalancer
from hetseq_hpc.config.compose import compose_run_config
from hetseq_hpc.errors import ConfigError
from hetseq_hpc.train.compile import compiles
from hetseq_hpc.train.records import StepStats
from hetseq_hpc.train.recovery.timeouts import StepTimeout


@pytest.mark.parametrize(
    "mode, cpu, cuda", [("on", True, True), ("off", False, False), ("auto", False, True)]
)
def test_auto_compiles_on_a_gpu_only(mode, cpu, cuda):
    assert compiles(mode, torch.device("cpu")) is cpu
    assert compiles(mode, torch.device("cuda", 0)) is cuda


def test_the_default_is_auto_and_a_bad_value_is_one_line_naming_the_choices():
    assert compose_run_config([]).trainer.compile == "auto"
    with pytest.raises(ConfigError) as err:
        compose_run_config(["trainer.compile=fast"])
    message = str(err.value)
    assert "trainer.compile=fast" in message and "on, off or auto" in message
    assert "\n" not in message


def test_a_compiling_step_gets_the_allowance_once_and_is_not_a_step_time():
    timeout = StepTimeout(10.0)
    timeout.predict(1.0)
    assert timeout.seconds == 10.0
    assert timeout.allow(300.0)  # stale: to be applied
    assert timeout.seconds == 310.0
    timeout.observe(95.0)  # the step that compiled: its time is not a step time
    assert timeout.seconds == 10.0 and not timeout.recent
    timeout.observe(2.0)  # the next step is measured as before
    assert timeout.seconds == 10.0 and list(timeout.recent) == [2.0]


def _stats(samples, seconds):
    return [
        StepStats(
            loss_sum=0.0,
            count=b,
            samples=b,
            step_time_s=0.0,
            data_time_s=0.0,
            compute_time_s=t,
        )
        for b, t in zip(samples, seconds)
    ]


def test_a_compiling_first_step_does_not_move_the_split():
    """Two equal ranks; rank 0's first step took 40 s (its compile). The re-balancer keeps
    the fastest of each rank's steps, so the one slow step moves nothing (and a real
    imbalance is still acted on): no step needs to be left out for a compile."""
    for slow, want in ((0.16, None), (0.32, [22, 10])):
        reb = Rebalancer(caps=[64, 64], threshold=0.1)
        alloc = allocate([1.0, 1.0], 32, [64, 64], forced=[16, 16])
        reb.record(_stats([16, 16], [40.0, slow]))
        for _ in range(9):
            reb.record(_stats([16, 16], [0.16, slow]))
        new = reb.observe(10, alloc)
        assert (new.samples if new else None) == want
