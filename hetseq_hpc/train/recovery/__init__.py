"""In-job recovery: :class:`~hetseq_hpc.train.recovery.elastic.ElasticWorld` re-forms the world
after a lost rank and has the training state (:class:`~hetseq_hpc.train.recovery.state.TrainState`)
redo what was interrupted (``sharded``: an FSDP run reloads its last checkpoint), the phases'
collective timeouts (``timeouts``) and the end of a run that lost a rank after its last step
(``run_end``). Design: docs/design/elastic-recovery.md."""
