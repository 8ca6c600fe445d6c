"""``python -m hetseq_hpc.plan [overrides] [plan.KEY=VALUE ...]``: see :mod:`hetseq_hpc.plan.cli`."""

import sys

from hetseq_hpc.plan.cli import main

sys.exit(main())
