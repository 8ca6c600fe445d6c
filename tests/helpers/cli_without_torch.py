"""Run the CLI (``python -m hetseq_hpc``) in this process and write, to the file named by
``$HETSEQ_TORCH_IMPORTED``, the stack of the first ``import torch`` it makes (the ranks are
processes of their own: they import torch, this does not look at them).

    HETSEQ_TORCH_IMPORTED=/tmp/stack.txt python tests/helpers/cli_without_torch.py key=value ...
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from typing import Any, Optional


class _FirstTorchImport:
    """A meta-path finder that finds nothing: it writes the importer's stack once."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if name == "torch":
            sys.meta_path.remove(self)
            with open(os.environ["HETSEQ_TORCH_IMPORTED"], "w") as out:
                out.write("".join(traceback.format_stack()))
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, _FirstTorchImport())
    sys.argv = ["hetseq_hpc", *sys.argv[1:]]
    runpy.run_module("hetseq_hpc", run_name="__main__", alter_sys=True)
