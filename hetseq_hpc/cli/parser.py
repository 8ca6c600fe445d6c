"""The ``hetseq-hpc`` command line: one tool, one subcommand per job (argparse sub-parsers).

::

    hetseq-hpc [run] [OVERRIDES]        train (the default: ``hetseq-hpc task=bert`` runs)
    hetseq-hpc plan [OVERRIDES]         predicted split, step time and efficiency
    hetseq-hpc plan --when [OVERRIDES]  the partition mix that finishes first (Slurm's estimates)
    hetseq-hpc probe [OVERRIDES]        measure this node's devices -> JSON for plan.probe=
    hetseq-hpc render [OVERRIDES]       write the job.sbatch `run` would submit
    hetseq-hpc report RUN_DIR           per-rank PNG and a text summary of a run
    hetseq-hpc prepare [OVERRIDES]      build the task's data caches before any job
    hetseq-hpc export RUN_DIR           the trained model: transformers directory or safetensors

OVERRIDES are Hydra overrides (``key=value``, ``group=option``) after the subcommand, as for
``python -m hetseq_hpc``. Errors are one ``hetseq-hpc: error: ...`` line on stderr, exit code 2
for a bad value, 1 for a failure while running. A first word that is neither a command nor an
override (no ``=``) is an unknown command, named with the closest commands
(:func:`bare_word_problem`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hetseq_hpc import __version__
from hetseq_hpc.cli.overrides import GROUPS, group_options, refuse_internal_options
from hetseq_hpc.config.aliases import migrate_overrides
from hetseq_hpc.errors import PROG, ConfigError, HetseqError, report_error

#: subcommand -> one-line help (``hetseq-hpc --help`` lists them in this order)
COMMANDS: Dict[str, str] = {
    "run": "train here (cluster=local) or submit one SLURM het job; the default",
    "plan": "predict split, step time and efficiency before submitting",
    "probe": "measure this node's devices on the task; JSON for plan.probe=",
    "render": "write the job.sbatch `run` would submit (sbatch it by hand)",
    "report": "per-rank PNG and a text summary of a run directory",
    "prepare": "build the task's data caches (tokenizer, tokens) before any job",
    "export": "write a run's trained model: a transformers directory (task=hf) or safetensors",
}
EPILOG = """examples:
  hetseq-hpc task=bert                                  # = hetseq-hpc run task=bert
  hetseq-hpc plan cluster=mixed task=bert trainer.global_batch_size=4096
  hetseq-hpc plan --when cluster=mixed task=bert trainer.max_steps=10000
  hetseq-hpc prepare task=bert task.data.files='[/data/books/*.txt]'
  hetseq-hpc render cluster=mixed task=bert hydra.run.dir=runs/b1 && sbatch runs/b1/job.sbatch
  hetseq-hpc report runs/b1
Each command has --help. Configuration groups and their options: hetseq-hpc run --help."""


def _formatter(prog: str) -> argparse.HelpFormatter:
    """Raw descriptions, 100 columns: every subcommand's help stays on one line."""
    return argparse.RawDescriptionHelpFormatter(prog, width=100, max_help_position=16)


def _overrides_parser(sub, name: str, description: str, epilog: str = ""):
    parser = sub.add_parser(
        name,
        help=COMMANDS[name],
        description=description,
        epilog=epilog,
        formatter_class=_formatter,
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="OVERRIDE",
        help="Hydra overrides: group=option or key=value",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one sub-parser per entry of :data:`COMMANDS`."""
    from hetseq_hpc.cli import probe

    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=_formatter,
        epilog=EPILOG,
        description="Data-parallel PyTorch training across heterogeneous GPU partitions, "
        "with per-rank shares proportional to measured throughput.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _overrides_parser(
        sub,
        "run",
        "Train: compose conf/ with the overrides, validate, then start "
        "the ranks (cluster=local) or submit one het job (SLURM clusters).",
        run_help(),
    )
    plan_parser = _overrides_parser(
        sub,
        "plan",
        "Predict, before submitting, the per-rank "
        "split, step time, samples/s and efficiency (nothing is "
        "launched).",
        PLAN_HELP,
    )
    plan_parser.add_argument(
        "--when",
        action="store_true",
        help="time to result: rank the mixes of the partitions by expected "
        "finish (Slurm's start estimate, sbatch --test-only, + predicted run "
        "time); = plan.when=true; nothing is submitted",
    )
    probe_parser = _overrides_parser(sub, "probe", probe.DESCRIPTION, probe.EPILOG)
    probe_parser.add_argument(
        "--out",
        help="JSON file to write (default: probe-<partition or "
        "host>.json in the current directory)",
    )
    probe_parser.add_argument(
        "--append", action="store_true", help="add this node's devices to an existing --out file"
    )
    _overrides_parser(
        sub,
        "render",
        "Write <run dir>/job.sbatch and hetseq_config.yaml, the "
        "script `run` would submit, and submit nothing (= cluster.dry_run=true). "
        "Submit it by hand with: sbatch <run dir>/job.sbatch",
    )
    report = sub.add_parser(
        "report",
        help=COMMANDS["report"],
        formatter_class=_formatter,
        description="Write RUN_DIR/ranks.png (per-rank step time and samples "
        "per step) and print a text summary of the run.",
    )
    report.add_argument("run_dir", help="run directory (holds metrics.jsonl)")
    report.add_argument("--out", help="PNG to write (default RUN_DIR/ranks.png)")
    export = sub.add_parser(
        "export",
        help=COMMANDS["export"],
        formatter_class=_formatter,
        description="Write the model of RUN_DIR's newest checkpoint that "
        "verifies (full state, also for sharding.mode=fsdp runs): for task=hf a "
        "directory that transformers' from_pretrained loads (config, tokenizer, "
        "safetensors), else one safetensors file.",
    )
    export.add_argument("run_dir", help="run directory (holds checkpoints/)")
    export.add_argument(
        "--out",
        help="task=hf: a new or empty directory, or an earlier export of this run "
        "(default RUN_DIR/hf_model); other tasks, or a name ending in .safetensors: the "
        "file to write (default RUN_DIR/model.safetensors)",
    )
    export.add_argument("--checkpoint", help="a checkpoint file instead of the newest one")
    _overrides_parser(
        sub,
        "prepare",
        "Build the task's caches (tokenizer, packed token array) "
        "on this machine, before any job: on a login node, or with srun. "
        "Streams in bounded memory on all cores; safe to interrupt and re-run.",
    )
    return parser


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


#: the plan command's epilog: its options live in the ``plan`` config group (importing the
#: planner for a help text, numpy and the cost model, cost every command ~0.3 CPU-s)
PLAN_HELP = (
    "Planner options are the plan config group, plan.KEY=VALUE (plan.probe, plan.link_gbps,\n"
    "plan.mfu, plan.when, ...): hetseq_hpc/config/plan.py lists them with their defaults,\n"
    "docs/design/planner.md explains each and the cost model."
)


#: words people type for a command, and the command they mean (for "did you mean")
ALIASES: Dict[str, str] = {
    "train": "run",
    "start": "run",
    "submit": "run",
    "fit": "run",
    "dry-run": "render",
    "sbatch": "render",
    "plot": "report",
    "summary": "report",
    "predict": "plan",
    "calibrate": "probe",
    "measure": "probe",
    "tokenize": "prepare",
    "help": "--help",
    "version": "--version",
}


def bare_word_problem(argv: Sequence[str]) -> Optional[str]:
    """Why ``argv`` cannot be a command line, or None: a first word that is neither a command,
    an option nor an override (no ``=``; Hydra's ``~key`` deletes are overrides) is an unknown
    command; a later such word in a command's overrides is not an override. The message names
    the word, the closest commands (:mod:`difflib`, also through :data:`ALIASES`) and the fix."""
    argv = list(argv)
    if not argv:
        return None
    first = argv[0]
    if first not in COMMANDS and _is_bare(first):
        return _unknown_command(first)
    command, rest = (first, argv[1:]) if first in COMMANDS else ("run", argv)
    if command in ("report", "export") or any(a.startswith("-") for a in argv):
        return None  # report and export take a path; flags: argparse or Hydra (multirun) parse them
    for word in rest:
        if _is_bare(word):
            if word in COMMANDS:
                return (
                    f"{word!r} after {command!r} is not an override: give one command, "
                    f"first (hetseq-hpc {word} OVERRIDES)"
                )
            return (
                f"{word!r} is not an override: overrides are key=value or group=option "
                f"(e.g. task=bert); see hetseq-hpc {command} --help"
            )
    return None


def _is_bare(word: str) -> bool:
    return "=" not in word and not word.startswith(("-", "~"))


def _unknown_command(word: str) -> str:
    import difflib

    guesses: Dict[str, str] = {}  # command -> how it is shown; closest first
    matches = difflib.get_close_matches(word.lower(), [*COMMANDS, *ALIASES], n=3, cutoff=0.6)
    for name in ([word.lower()] if word.lower() in ALIASES else []) + matches:
        command = ALIASES.get(name, name)
        if command not in guesses:  # an alias shows the word it stands for: 'run' (train)
            note = name in ALIASES and name != word.lower()
            guesses[command] = repr(command) + (f" ({name})" if note else "")
    hint = f"did you mean {' or '.join(guesses.values())}? " if guesses else ""
    return (
        f"unknown command {word!r}: {hint}commands: {', '.join(COMMANDS)} (or give "
        "overrides key=value for run); see hetseq-hpc --help"
    )


def _split(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``(argparse's part, the rest)``: Hydra's own flags (``-m``, ``--cfg``, ...) after a
    subcommand bypass argparse and go to Hydra with the overrides."""
    argv = list(argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv = ["run", *argv]  # the default subcommand
    if argv[0] in ("run", "render") and any(
        a.startswith("-") and a not in ("-h", "--help") for a in argv[1:]
    ):
        return argv[:1] + [a for a in argv[1:] if a in ("-h", "--help")], [
            a for a in argv[1:] if a not in ("-h", "--help")
        ]
    return argv, []


def dispatch_command(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand; returns the exit code.
    Output into a closed pipe (``hetseq-hpc --help | head``) ends quietly."""
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        # Python's advice for pipes: point stdout at devnull so the exit flush stays quiet
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


def _main(argv: List[str]) -> int:
    problem = bare_word_problem(argv)
    if problem:
        return report_error(ConfigError(problem))
    own, hydra_flags = _split(argv)
    args = build_parser().parse_args(own)
    if getattr(args, "overrides", None):  # keys that moved between groups keep working
        args.overrides = migrate_overrides(args.overrides)
    hydra_flags = migrate_overrides(hydra_flags)
    handlers: Dict[str, Callable[[argparse.Namespace, List[str]], int]] = {
        "run": _run,
        "render": _render,
        "plan": _plan,
        "probe": _probe,
        "report": _report,
        "prepare": _prepare,
        "export": _export,
    }
    try:
        return handlers[args.command](args, hydra_flags)
    except HetseqError as exc:
        return report_error(exc)


def _run(args: argparse.Namespace, hydra_flags: List[str]) -> int:
    from hetseq_hpc.cli.run import run

    return run([*hydra_flags, *args.overrides])


def _render(args: argparse.Namespace, hydra_flags: List[str]) -> int:
    from hetseq_hpc.cli.run import render

    return render([*hydra_flags, *args.overrides])


def _plan(args: argparse.Namespace, hydra_flags: List[str]) -> int:
    from hetseq_hpc.cli.when_command import wants_when, when_command
    from hetseq_hpc.plan.command import plan_command

    refuse_internal_options(args.overrides)
    if args.when or wants_when(args.overrides):
        return when_command(args.overrides)
    return plan_command(args.overrides)


def _probe(args: argparse.Namespace, hydra_flags: List[str]) -> int:
    from hetseq_hpc.cli.probe import probe_command

    path = probe_command(args.overrides, args.out, args.append)
    print(path)
    return 0


def _report(args: argparse.Namespace, hydra_flags: List[str]) -> int:
    from hetseq_hpc.report.plots import plot_run, text_summary

    path = plot_run(args.run_dir, args.out)
    print(text_summary(args.run_dir))
    print(f"plot: {path}")
    return 0


def _export(args: argparse.Namespace, hydra_flags: List[str]) -> int:
    from hetseq_hpc.cli.export import export_command

    done = export_command(args.run_dir, args.out, args.checkpoint)
    note = done.note()
    if note:
        print(f"{PROG}: {note}", file=sys.stderr)
    print(done.line())
    return 0


def _prepare(args: argparse.Namespace, hydra_flags: List[str]) -> int:
    from hetseq_hpc.cli.prepare import prepare_command

    print(prepare_command(args.overrides))
    return 0
