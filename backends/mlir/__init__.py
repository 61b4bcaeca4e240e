"""The graph through torch-mlir: MLIR export into the dump directory, and a CPU reference
execution that checks it against eager PyTorch.

* ``extract``: any set of nodes -> a standalone GraphModule (inputs = values flowing in,
  outputs = values flowing out). Pure torch.fx.
* ``lower``: FX -> torch dialect -> linalg-on-tensors with MLIR's diagnostics kept
  (``lower_graph``), and parsing the files back (``parse_module``).
* ``probe``: which ops do not lower, and why (each op lowered alone).
* ``export``: ``DUMP/mlir/`` (graph, fusion groups, ``unsupported.txt``, ``index.json``);
  ``dump_mlir`` is the compile's guarded entry point.
* ``refbackend``: a linalg module JIT-compiled by MLIR's ExecutionEngine, called with tensors.
* ``refcheck``: MLIR against eager on random inputs or on the values of a real step.

torch-mlir is optional at runtime: nothing here imports it at module load (``lower.
available()`` says whether it can be imported), so ``gemc`` imports on machines without it.
"""
