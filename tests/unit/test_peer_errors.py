"""Which errors of a step are a peer's failure (a lost or silent rank), not a bug: the
launcher's blame (``is_peer_error``) and in-job recovery (``is_peer_failure``) must agree."""

from __future__ import annotations

import pytest

from hetseq_hpc.distributed.membership import is_peer_failure
from hetseq_hpc.env.rank_guard import is_peer_error
from hetseq_hpc.errors import ConfigError

#: gloo's timeout on a silent (SIGSTOPped) peer, as the step's stats future raises it
CALLBACK_TIMEOUT = (
    "Got the following error when running the callback: RuntimeError: "
    "Application timeout caused pair closure"
)


@pytest.mark.parametrize(
    "message",
    [CALLBACK_TIMEOUT, "Connection closed by peer [127.0.0.1]:1234", "Broken pipe"],
)
def test_a_silent_or_lost_peer_is_a_peer_failure_for_both(message):
    assert is_peer_error(f"RuntimeError: {message}")
    assert is_peer_failure(RuntimeError(message))


def test_our_own_errors_and_bugs_are_not():
    assert not is_peer_failure(ConfigError("trainer.max_steps=-1: set a positive number"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_error("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
