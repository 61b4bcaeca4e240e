"""The zoo: models of the GEM family written from their papers, in their authors' idioms.

Each module is self-contained (gemc loads ``examples/zoo/NAME.py:build`` by path) and has
``build(preset="tiny"|"h200", batch_size=None, seed=0) -> gemc.ModelSpec``. Which idioms
each carries is in its docstring; ``tests/zoo`` checks them, ``benchmarks/zoo_applied.py``
says what gemc applied to each.
"""

MODELS = ("dlrm_dcnv2", "hstu", "sasrec_bst", "din", "wukong", "mmoe", "transact")
