"""The uneven-batch DDP training loop and what it needs: data order, comm hook, checkpoints,
metrics."""
