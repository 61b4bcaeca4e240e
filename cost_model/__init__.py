"""gemc's cost model: what a plan will cost on a given cluster.

Small modules, read in this order:

- ``hardware``     datasheet peaks of A100/H100/H200/B200 (``get_gpu``)
- ``topology``     the cluster as a networkx graph (``parse_topology``, ``Topology``)
- ``collectives``  α-β time of NCCL collectives on a placement (``collective_time``)
- ``kernels``      FLOPs and bytes of each kernel kind, forward and backward
- ``calibration``  the measured-efficiency file (``load_calibration``, ``default_calibration``)
- ``calibrate``    the microbenchmarks that write it (``run_calibration``; needs a GPU)
- ``op_cost``      one fx node's forward/backward time (``node_cost``)
- ``activations``  what autograd saves for backward, from the graph
- ``memory``       per-rank bytes by strategy and optimizer
- ``types``        plain inputs/outputs of the step model (no fx)
- ``step_model``   a sharded plan's step time, MFU, per-rank memory (``predict_step``)
- ``eager``        one eager single-GPU step (what the accuracy benchmark checks)

Nothing here imports ortools or torch-mlir.
"""
