"""``python -m gemc.run PLAN ...``: the module torchrun starts, one process per rank.

    torchrun --nproc_per_node=2 -m gemc.run plan.json --steps 100 --checkpoint-dir ckpt

The runner itself lives in ``gemc.backends.torch`` (see its ``cli`` module for the options);
this module is only the entry point, so that ``-m gemc.run`` is short and stable.
"""

from __future__ import annotations

import os
import sys

from gemc.backends.torch.cli import main
from gemc.backends.torch.comm import exit_skipping_finalization

if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a process group was used
        exit_skipping_finalization(code)
    sys.exit(code)
