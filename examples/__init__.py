"""Complete user tasks for hetseq_hpc (see docs/tasks.md)."""
