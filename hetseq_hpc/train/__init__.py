"""Training on one rank: the Trainer (``trainer``), its strategies (``parallel``: DDP or
FSDP2), ``checkpoint/``, ``recovery/`` (in-job recovery), ``metrics/``; docs/architecture.md."""
