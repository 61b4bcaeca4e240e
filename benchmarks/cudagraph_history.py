"""Run ``python SCRIPT.py ARGS`` with Inductor's CUDA-graph allocation history recorded, so a
"tensor(s) in the cudagraph pool not tracked as outputs" error names where each tensor was
allocated. A debugging wrapper for ``zoo.py --child-prefix`` (``h100_session29.sh`` part 2):
``zoo.py --child-prefix "python3 benchmarks/cudagraph_history.py"`` runs each child under it."""

import runpy
import sys

import torch._inductor.config as inductor_config

inductor_config.triton.cudagraph_trees_history_recording = True
args = sys.argv[1:]
if args and not args[0].endswith(".py"):  # the interpreter zoo.py puts first
    args = args[1:]
if not args:
    sys.exit("usage: python3 benchmarks/cudagraph_history.py [python] SCRIPT.py [ARGS...]")
sys.argv = args
runpy.run_path(args[0], run_name="__main__")
