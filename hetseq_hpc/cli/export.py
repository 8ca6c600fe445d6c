"""``hetseq-hpc export RUN_DIR [--out PATH]``: a run's trained model, for inference.

The checkpoint is the one ``trainer.resume=auto`` would take (the newest that verifies and
belongs to the current run; a newer refused one is named, with why, in one line) or the one
``--checkpoint`` names. An FSDP run's shards are read whole on this one process.

* ``task=hf`` (from the run's ``hetseq_config.yaml``): a transformers directory (default
  ``RUN_DIR/hf_model``) that ``AutoModel*.from_pretrained`` and ``AutoTokenizer.from_pretrained``
  load (:mod:`hetseq_hpc.tasks.hf.export`), plus :data:`MARKER`. It is written in a temp
  folder beside ``--out`` and renamed in place. An existing ``--out`` must be an empty folder
  or an earlier export of the same run (its :data:`MARKER`), which is replaced whole.
* Other tasks, or an ``--out`` ending in ``.safetensors``: one safetensors file (default
  ``RUN_DIR/model.safetensors``) of the task model's ``state_dict()`` under its own names
  (tied weights under each name; ``task=hf``: ``model.`` + transformers' name).

``--out`` is checked before any checkpoint is read; nothing half-written stays.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from safetensors import SafetensorError
from safetensors.torch import save_file

from hetseq_hpc.config import load_run_config
from hetseq_hpc.config.hf_tasks import HfModelConfig
from hetseq_hpc.errors import CheckpointError, ConfigError, HetseqError
from hetseq_hpc.files.atomic import atomic_write_json, current_umask, temp_path_for
from hetseq_hpc.files.user_input import folder_problem, output_problem
from hetseq_hpc.rundir.history import current_run_id
from hetseq_hpc.rundir.paths import RunDir
from hetseq_hpc.tasks.cache import TaskCache
from hetseq_hpc.tasks.hf.export import PretrainedExport
from hetseq_hpc.tasks.hf.task import HfTask
from hetseq_hpc.train.checkpoint.manager import CheckpointManager
from hetseq_hpc.train.checkpoint.shards import full_state, shard_dir_of

#: written into an exported transformers directory: which run and step it holds
MARKER = "hetseq_export.json"
_WRITE_ERRORS = (OSError, SafetensorError, RuntimeError)


@dataclass
class Exported:
    """What :func:`export_command` wrote.

    Attributes:
        target: the file or directory written.
        step: the exported checkpoint's step.
        source: that checkpoint.
        skipped: ``(newer checkpoint, one-line reason)`` of those passed over, newest first
            (they do not verify, or another run wrote them).
    """

    target: Path
    step: int
    source: Path
    skipped: List[Tuple[Path, str]] = field(default_factory=list)

    def note(self) -> Optional[str]:
        """One line saying which newer checkpoint was refused and why, or None."""
        if not self.skipped:
            return None
        why = self.skipped[0][1].rsplit(": ", 1)[0]  # every reason ends ": <fix>"
        more = f" (and {len(self.skipped) - 1} more)" if len(self.skipped) > 1 else ""
        return f"note: {why}{more}; exported step {self.step} ({self.source}) instead"

    def line(self) -> str:
        """``exported step N (checkpoint) to TARGET``."""
        return f"exported step {self.step} ({self.source}) to {self.target}"


def export_command(
    run_dir: str, out: Optional[str] = None, checkpoint: Optional[str] = None
) -> Exported:
    """Export the model of ``run_dir``'s checkpoint (see the module docstring).

    Raises:
        ConfigError: ``--out`` cannot be written, or a ``task=hf`` run's model directory or
            saved configuration cannot be read; checked before any checkpoint is read.
        CheckpointError: no checkpoint verifies (or the named one does not), its weights do
            not fit the model directory, or the write fails; one line naming the file and the
            fix. Nothing half-written stays.
    """
    folder = RunDir(Path(run_dir).expanduser())
    if not folder.root.is_dir():  # read-only is fine: only --out is written
        raise CheckpointError(
            f"run directory {str(folder)!r} does not exist or is not a "
            "directory: pass the hydra.run.dir of a run that wrote checkpoints"
        )
    one_file = out is not None and out.endswith(".safetensors")
    model_cfg = None if one_file else saved_hf_model(folder)
    if model_cfg is None:
        target = Path(out).expanduser() if out else folder.export_file
        problem = output_problem(target)
        problem = problem and f"{problem}: give a writable file, e.g. --out model.safetensors"
    else:
        target = Path(out).expanduser() if out else folder.export_dir
        problem = directory_problem(target, folder)
    if problem:
        shown = f"--out {target}" if out else str(target)
        raise ConfigError(f"{shown} {problem}")
    exporter = None
    if model_cfg is not None:  # the model directory is read before any checkpoint
        exporter = PretrainedExport.for_run(model_cfg, lambda: label_names(folder))
    choice = CheckpointManager(folder).choose(checkpoint or "auto", log_other_runs=False)
    if choice.path is None or choice.state is None:
        raise CheckpointError(
            f"run directory {str(folder)!r} has no checkpoint: train first "
            "(checkpoints are written every trainer.checkpoint_every steps "
            "and at the end)"
        )
    state = choice.state
    if "shards" in state:  # an FSDP run's sharded checkpoint: its model, read whole
        state["model"] = full_state(shard_dir_of(choice.path, state), [], optimizer=False)["model"]
    state.pop("optimizer", None)  # the moments are not exported: free them first
    passed_over = sorted(choice.skipped + choice.others, reverse=True)  # newest first
    done = Exported(target, int(state["step"]), choice.path, passed_over)
    if exporter is None:
        write_one_file(state, choice.path, target)
    else:
        marker = {
            "run_dir": str(folder.root.resolve()),
            "run_id": str(state.get("run_id") or ""),
            "step": done.step,
            "checkpoint": str(choice.path),
        }
        write_directory(exporter, state["model"], target, marker)
    return done


def saved_hf_model(folder: RunDir) -> Optional[HfModelConfig]:
    """The ``task.model`` group of a ``task=hf`` run's ``hetseq_config.yaml``, its paths
    checked; None for another task or when the file is missing.

    Raises:
        ConfigError: the file cannot be read, or the model directory is gone (one line).
    """
    path = folder.config
    if not path.exists():
        return None
    fix = "export one file instead with --out FILE.safetensors"
    try:
        saved = OmegaConf.load(path)
        if OmegaConf.select(saved, "task.name") != "hf":
            return None
        node = OmegaConf.merge(OmegaConf.structured(HfModelConfig), saved.task.model)
        model_cfg = OmegaConf.to_object(node)
    except Exception as exc:  # YAML, OmegaConf and schema errors
        first = (str(exc).splitlines() or [""])[0]
        raise ConfigError(f"{path} cannot be read ({type(exc).__name__}: {first}): {fix}") from None
    assert isinstance(model_cfg, HfModelConfig)
    for key in ("path", "config", "tokenizer"):
        value = getattr(model_cfg, key)
        if value is not None and not os.path.exists(os.path.expanduser(value)):
            raise ConfigError(
                f"the run's task.model.{key}={value!r} ({path}) is gone: export reads its "
                f"config and tokenizer; restore it there, or {fix}"
            )
    model_cfg.check_paths()
    return model_cfg


def label_names(folder: RunDir) -> Optional[List[str]]:
    """A classification run's class names (``summary.json``'s ``task.data.labels``, else the
    ``meta.json`` of its token cache); None when neither is there."""
    summary = folder.summary
    try:
        labels = json.loads(summary.read_text(encoding="utf-8"))["task"]["data"]["labels"]
        if isinstance(labels, list):
            return [str(name) for name in labels]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:  # the cache the run trained from, when its data files are unchanged
        run = load_run_config(folder.config)
        cache = TaskCache(HfTask(run.task, run.trainer.seed).directory)
        labels = cache.read_meta().get("label_names")
    except (HetseqError, OSError, ValueError, AttributeError):
        return None
    return [str(name) for name in labels] if isinstance(labels, list) else None


def _export_of(target: Path) -> Dict[str, Any]:
    """The :data:`MARKER` of an exported directory, or ``{}``."""
    try:
        data = json.loads((target / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def directory_problem(target: Path, folder: RunDir) -> Optional[str]:
    """Why the transformers directory cannot be written at ``target``, as a phrase with the
    fix, or None: it must be missing, an empty folder, or an earlier export of the same run
    (:data:`MARKER` names this run directory and its current run id); the folder that holds
    it must take a new folder (the temp folder is made beside it)."""
    fix = "give a new or empty directory, e.g. --out my-model"
    if os.path.lexists(target) and not target.is_dir():
        return f"is not a directory: {fix}"
    if target.is_dir() and any(target.iterdir()):
        earlier = _export_of(target)
        run_id = current_run_id(folder) or ""
        same = earlier.get("run_dir") == str(folder.root.resolve()) and (
            earlier.get("run_id") == run_id or not run_id
        )
        if not same:
            return (
                f"is a non-empty directory that is not an earlier export of this run "
                f"(no {MARKER} naming {folder}; nothing was written): {fix}"
            )
    problem = folder_problem(target.absolute().parent)
    where = "give a directory in a writable place, e.g. --out my-model"
    return f"cannot be created ({problem}): {where}" if problem else None


def _usual_mode(files: Iterable[Path]) -> None:
    """Give ``files`` the mode a new file gets under the umask (safetensors makes 0600)."""
    mask = current_umask()
    for path in files:
        os.chmod(path, 0o666 & ~mask)


def write_one_file(state: Dict[str, Any], source: Path, target: Path) -> None:
    """``state["model"]`` as one safetensors file at ``target`` (temp file, rename), tied
    weights each under their own name, metadata ``step``, ``run_id``, ``source``.

    Raises:
        CheckpointError: it cannot be written (one line); the temp file is removed.
    """
    tensors, seen = {}, set()
    for k, v in state["model"].items():  # tied weights: each name gets its own storage
        v = v.detach().contiguous()
        tensors[k] = v.clone() if v.untyped_storage().data_ptr() in seen else v
        seen.add(v.untyped_storage().data_ptr())
    metadata = {
        "format": "pt",
        "step": str(state["step"]),
        "run_id": str(state.get("run_id", "")),
        "source": str(source),
    }
    tmp = temp_path_for(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        _usual_mode([tmp])
        os.replace(tmp, target)
    except _WRITE_ERRORS as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"cannot write {str(target)!r} ({getattr(exc, 'strerror', None) or exc}): "
            "choose another --out"
        ) from None


def write_directory(
    exporter: PretrainedExport,
    model_state: Dict[str, torch.Tensor],
    target: Path,
    marker: Dict[str, Any],
) -> None:
    """The transformers directory at ``target``: built in ``.<name>.<pid>.tmp`` beside it,
    then renamed in place (an earlier export there is moved aside first and removed after).

    Raises:
        CheckpointError: the weights do not fit (nothing written) or the write fails (the
            temp folder is removed, an earlier export is kept); one line.
    """
    model = exporter.build(model_state)
    tmp = temp_path_for(target)
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    moved = False
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(tmp)
        exporter.save(model, tmp)
        atomic_write_json(tmp / MARKER, marker)
        _usual_mode(p for p in tmp.rglob("*") if p.is_file())
        if target.is_dir() and any(target.iterdir()):  # an earlier export of this run
            os.replace(target, old)
            moved = True
        os.replace(tmp, target)
    except _WRITE_ERRORS as exc:
        raise CheckpointError(
            f"cannot write {str(target)!r} ({getattr(exc, 'strerror', None) or exc}): "
            "free space or choose another --out"
        ) from None
    finally:  # also on Ctrl-C: the new export or the earlier one is at target, never neither
        shutil.rmtree(tmp, ignore_errors=True)
        if moved and os.path.lexists(target):
            shutil.rmtree(old, ignore_errors=True)
        elif moved:
            os.replace(old, target)


__all__ = ["MARKER", "Exported", "export_command"]
