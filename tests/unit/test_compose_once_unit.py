"""Issue 42: the configuration is composed once (in-process: the composer Hydra is handed, the
loading of a new run and of a resumed one), and the command line keeps no state in module
globals. (The real command line counted: tests/integration/test_compose_once.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.types import RunMode

import hetseq_hpc.cli
from hetseq_hpc.cli.load import load_run
from hetseq_hpc.config import save_run_config
from hetseq_hpc.config.composer import Composer


@pytest.fixture
def compositions(monkeypatch):
    """Every composition Hydra's config loader makes: ``[(mode, overrides)]``."""
    made = []
    load = ConfigLoaderImpl.load_configuration

    def counted(self, config_name, overrides, run_mode, *args, **kwargs):
        made.append((run_mode, list(overrides)))
        return load(self, config_name, overrides, run_mode, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counted)
    return made


def test_the_composer_composes_a_command_line_once_and_hands_out_copies(compositions):
    composer = Composer()
    first = composer.compose(["trainer.max_steps=3", "hydra.run.dir=runs/x"])
    first.trainer.max_steps = 99  # what Hydra does to the config it is handed
    again = composer.load_configuration(
        "config", ["trainer.max_steps=3", "hydra.run.dir=runs/x"], RunMode.RUN
    )
    assert again.trainer.max_steps == 3 and again.hydra.run.dir == "runs/x"
    assert len(compositions) == 1
    sweep = composer.compose(["trainer.max_steps=1,2"], RunMode.MULTIRUN)
    point = composer.load_sweep_config(sweep, ["trainer.max_steps=2"])
    assert composer.load_sweep_config(sweep, ["trainer.max_steps=2"]) == point
    assert point.trainer.max_steps == 2
    assert [mode for mode, _ in compositions] == [RunMode.RUN, RunMode.MULTIRUN, RunMode.RUN]


def test_loading_a_new_run_and_a_resumed_one_composes_once_each(tmp_path, compositions):
    run_dir = tmp_path / "run"
    loaded = load_run(["cluster.ranks=1", "trainer.max_steps=3", f"hydra.run.dir={run_dir}"])
    assert loaded.hydra is not None and not loaded.existed
    assert (loaded.run.trainer.max_steps, loaded.run_dir.root) == (3, run_dir)
    # Hydra is handed that composition: asking again composes nothing
    loaded.hydra.composer.load_configuration("config", list(loaded.hydra.overrides), RunMode.RUN)
    assert len(compositions) == 1
    assert compositions[0][1] == [*loaded.hydra.overrides]
    assert loaded.hydra.overrides[-2:] == (f"hydra.run.dir={run_dir}", "hydra.mode=RUN")
    assert not run_dir.exists()  # nothing written

    run_dir.mkdir()  # the run as its launcher saved it
    save_run_config(loaded.run, run_dir / "hetseq_config.yaml")
    resumed = load_run(["trainer.max_steps=5", f"hydra.run.dir={run_dir}"])
    assert resumed.hydra is None and resumed.saved == run_dir / "hetseq_config.yaml"
    assert (resumed.run.trainer.max_steps, resumed.run.cluster.ranks) == (5, 1)
    assert len(compositions) == 2


def test_the_command_line_keeps_no_state_in_module_globals():
    """No ``global`` statement, no assignment to ``sys.argv``, and every module-level name a
    constant (UPPER_CASE), the module's logger or ``__all__``, in hetseq_hpc/cli/."""
    found = []
    for path in sorted(Path(hetseq_hpc.cli.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                found.append(f"{path.name}:{node.lineno}: global {', '.join(node.names)}")
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if ast.unparse(target).startswith("sys.argv"):
                        found.append(f"{path.name}:{node.lineno}: sets sys.argv")
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    name = ast.unparse(target)
                    if not (name.isupper() or name in ("log", "__all__")):
                        found.append(f"{path.name}:{node.lineno}: module-level {name}")
    assert found == []
