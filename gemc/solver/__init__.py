"""The parallelism planners behind the ``parallelize`` pass.

Read in this order:

- ``problem``     what is decided (dense choices, table choices), read off the annotated graph
- ``candidates``  every option of every region and table priced once by the cost model
- ``evaluate``    a complete assignment's step time and per-rank memory (predict_step's
                  arithmetic on the precomputed options: fast enough for the inner loop)
- ``naive``       FSDP everywhere, tables table-wise round-robin
- ``greedy``      a largest-table-first heuristic on gemc's own cost model (its option order
                  borrowed from TorchRec's proposer): NOT TorchRec's planner, whose real plans
                  price 3-5x better (``benchmarks/vs_torchrec.py`` runs the real one)
- ``local_search`` one table moved at a time, exactly priced: CP-SAT's hint and its polish
- ``cpsat``       one OR-Tools CP-SAT model of the whole plan (the default planner)
- ``expand``      from the model's counts per bin to concrete ranks
- ``infeasible``  the error that names the binding memory constraint and the fixes

Only ``cpsat`` imports ortools, and only when it runs.
"""
