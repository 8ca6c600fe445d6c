"""Launchers: start the workers of a run (``local``: processes here; ``slurm``: one het job)."""
