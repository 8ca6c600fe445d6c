"""Checkpoints: :class:`~hetseq_hpc.train.checkpoint.manager.CheckpointManager` (save, load,
retention, verification, quarantine), the files of one checkpoint (``files``) and of a sharded
one (``shards``), and a finished run (``finished``). The model and optimizer state I/O is the
strategies' (:mod:`hetseq_hpc.train.parallel`)."""
