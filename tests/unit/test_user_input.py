"""Checks of the files users name (hetseq_hpc.files.user_input), in-process: what a path is (a
directory, a FIFO, missing), strict JSON. (Malformed inputs on the command line:
tests/integration/test_malformed_inputs.py.)
"""

from __future__ import annotations

import os

import pytest


def test_file_problem_and_strict_json_in_process(tmp_path):
    from hetseq_hpc.errors import ConfigError
    from hetseq_hpc.files.user_input import (
        file_problem,
        loads_strict,
        output_problem,
        read_json_file,
    )

    os.mkfifo(tmp_path / "f")
    (tmp_path / "ok.json").write_text('{"a": [1, 2.5, null]}')
    assert file_problem(tmp_path / "ok.json") is None
    assert file_problem(tmp_path) == "is a directory, not a file"
    assert file_problem(tmp_path / "f") == "is not a regular file (a FIFO)"
    assert file_problem(tmp_path / "ok.json" / "x").startswith("does not exist")
    assert output_problem(tmp_path / "new" / "x.json") is None
    assert read_json_file(tmp_path / "ok.json", "x", "fix") == {"a": [1, 2.5, None]}
    for text in ("NaN", "-Infinity", "1e999", "1" * 21):
        with pytest.raises(ValueError):
            loads_strict(text)
    with pytest.raises(ConfigError, match=r"^x is not a regular file \(a FIFO\): fix$"):
        read_json_file(tmp_path / "f", "x", "fix")
