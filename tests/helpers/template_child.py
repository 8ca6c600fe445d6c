"""A stand-in rank for the rank template's own tests: ``python -m tests.helpers.template_child
OUT CODE`` writes what it was given (environment, group, name, parent, argv, modules) to
``OUT`` as JSON, then exits with ``CODE``, or waits for ``OUT.go`` first when CODE is
``wait``."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    out, code = Path(sys.argv[1]), sys.argv[2]
    facts = {
        "rank": os.environ.get("RANK"),
        "only_rank": os.environ.get("ONLY_RANK"),
        "shared": os.environ.get("SHARED"),
        "pgid": os.getpgid(0),
        "ppid": os.getppid(),
        "name": Path("/proc/self/comm").read_text().strip(),
        "argv": sys.argv,
        "main": __name__,
        "torch_preloaded": "torch._dynamo" in sys.modules,
        "preloaded": sorted(m for m in ("wave", "tabnanny") if m in sys.modules),
        "gc_enabled": gc.isenabled(),
        "stdin_is_null": os.path.samefile("/proc/self/fd/0", os.devnull),
    }
    out.with_suffix(".tmp").write_text(json.dumps(facts))
    out.with_suffix(".tmp").rename(out)
    if code == "wait":
        while not out.with_suffix(".go").exists():
            time.sleep(0.05)
        return 0
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
