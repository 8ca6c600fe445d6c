"""``hetseq-hpc run`` and ``hetseq-hpc render``: the Hydra entry point, with the checks that
must come before Hydra writes anything.

Before Hydra starts (it creates the run directory and writes ``.hydra/`` at once):

1. an internal schema (``task=bert_schema``) is refused as an option;
2. the overrides are composed and validated (:func:`hetseq_hpc.cli.precheck_overrides`);
3. when ``hydra.run.dir`` holds an earlier run's ``hetseq_config.yaml`` and ``trainer.resume``
   is not ``never``, the run continues from that saved configuration with the command line's
   overrides on top (:mod:`hetseq_hpc.commands.resume`): checked against the checkpoint first,
   and started without Hydra, so the earlier run's ``.hydra/`` stays as it was.
"""

from __future__ import annotations

from typing import List, Sequence

from hetseq_hpc.errors import ConfigError

#: config groups whose options are files in conf/<group>/
GROUPS = ("task", "cluster", "trainer", "optim", "plan")


def group_options(group: str) -> List[str]:
    """The options of a config group: the YAML files in ``conf/<group>/`` (never the
    ``*_schema`` nodes, which only the YAML files build on)."""
    from hetseq_hpc.config import CONF_DIR

    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def refuse_internal_options(overrides: Sequence[str]) -> None:
    """Refuse ``group=<name>_schema``: the schemas are internal building blocks.

    Raises:
        ConfigError: one line naming the real options.
    """
    for arg in overrides:
        key, _, value = arg.lstrip("+~").partition("=")
        if key in GROUPS and value.strip().endswith("_schema"):
            options = ", ".join(group_options(key))
            raise ConfigError(f"{key}={value} is an internal schema, not an option: choose one "
                              f"of {options} (e.g. {key}={group_options(key)[0]})")


def run_help() -> str:
    """The ``run --help`` epilog: every group's options, the common keys, Hydra's flags."""
    lines = ["configuration groups (group=option):"]
    for group in GROUPS:
        lines.append(f"  {group:8s} {', '.join(group_options(group))}")
    lines += [
        "",
        "keys (key=value; every field with its meaning: hetseq_hpc/config/*.py):",
        "  cluster.ranks=4 trainer.global_batch_size=64 trainer.max_steps=200 optim.lr=3e-4",
        "  trainer.loggers=[jsonl,csv,tensorboard]  trainer.resume=auto|never|PATH",
        "  hydra.run.dir=runs/a  (an existing run there continues from its hetseq_config.yaml)",
        "",
        "Hydra's flags pass through: -m (sweep), --cfg job (print the config), --hydra-help.",
    ]
    return "\n".join(lines)


def run(argv: List[str]) -> int:
    """``hetseq-hpc run``: resume from a saved configuration, or hand ``argv`` to Hydra.

    Returns the exit code (Hydra's entry point exits by itself on errors).
    """
    from hetseq_hpc import cli
    from hetseq_hpc.commands.resume import resume_saved_run

    if any(a in ("-h", "--help") for a in argv):
        from hetseq_hpc.commands import build_parser

        build_parser().parse_args(["run", "--help"])
    refuse_internal_options(argv)
    if not any(a.startswith("-") for a in argv):
        resumed = resume_saved_run(argv)
        if resumed is not None:
            return resumed
    cli.run_with_hydra(argv)
    return 0


def render(argv: List[str]) -> int:
    """``hetseq-hpc render``: ``run`` with ``cluster.dry_run=true`` on a SLURM cluster.

    Raises:
        ConfigError: the composed cluster is ``local`` (nothing to render).
    """
    from hetseq_hpc.config import compose_run_config

    refuse_internal_options(argv)
    overrides = [a for a in argv if not a.startswith("-")
                 and not a.lstrip("+~").startswith("hydra.")]
    if compose_run_config(overrides).cluster.is_local:
        raise ConfigError("render writes a SLURM job script but cluster=local runs on this "
                          "machine: pick a SLURM cluster, e.g. cluster=mixed")
    return run([*argv, "cluster.dry_run=true"])
