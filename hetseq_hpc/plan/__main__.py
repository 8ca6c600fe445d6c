"""``python -m hetseq_hpc.plan [overrides] [plan.KEY=VALUE ...]``: see :mod:`hetseq_hpc.plan.command`."""

import sys

from hetseq_hpc.plan.command import plan_command

sys.exit(plan_command())
