"""hetseq_hpc: data-parallel PyTorch training across heterogeneous GPU partitions.

Data flow (one module per stage)::

    cli  ->  launch.local | launch.slurm          (start one worker per rank)
    worker:  env.world      (rank, world size, master from the environment)
             env.hardware   (pynvml probe, CPU fallback)
             distributed    (rendezvous: NCCL on GPUs, gloo on CPU)
             calibrate      (timed forward+backward of the real model)
             allocation     (per-rank micro-batch x accumulation, agreed by all ranks)
             train.trainer  (DDP or FSDP with exact global-batch gradients, checkpoints, metrics)
"""

__version__ = "0.1.0"
