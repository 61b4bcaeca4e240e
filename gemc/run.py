"""``python -m gemc.run PLAN ...``: the module torchrun starts, one process per rank.

    torchrun --nproc_per_node=2 -m gemc.run plan.json --steps 100 --checkpoint-dir ckpt

The runner itself lives in ``gemc.backends.torch`` (see its ``cli`` module for the options);
this module is only the entry point, so that ``-m gemc.run`` is short and stable.
"""

from __future__ import annotations

import sys

from gemc.backends.torch.cli import main

if __name__ == "__main__":
    sys.exit(main())
