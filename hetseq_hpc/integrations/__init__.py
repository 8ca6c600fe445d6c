"""hetseq_hpc's engine inside the trainers labs already use: a Lightning strategy
(:mod:`hetseq_hpc.integrations.lightning`), Fabric (:mod:`~hetseq_hpc.integrations.fabric`)
and accelerate (:mod:`~hetseq_hpc.integrations.accelerate`) helpers, and a cluster environment
for Slurm het jobs (:mod:`~hetseq_hpc.integrations.cluster`). Each imports its framework
itself (optional extras); nothing in hetseq_hpc imports this package. User guide:
docs/integrations.md."""
