"""Datasheet facts about the GPUs gemc plans for.

Every number here is a *dense* peak (no 2:4 structured sparsity) from NVIDIA's public
datasheets; the cost model multiplies them by measured efficiencies (see calibration.py),
so these are the roofline's ceilings, not predictions. Sources are kept on each spec so
the plan can cite them.

Units: FLOP/s, bytes/s, bytes. NVLink bandwidth is per GPU *per direction* (NVIDIA quotes
the bidirectional total: 600 GB/s for A100 = 300 GB/s each way). NIC speeds are Gb/s
(bits), as NICs are sold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gemc.errors import TopologyError

TERA = 1e12
GB = 1e9
MIB = 1 << 20


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model and the host it usually comes in (HGX/DGX board)."""

    name: str                   # canonical lower-case key: "h200"
    long_name: str              # "NVIDIA H200 SXM 141GB"
    fp32_flops: float           # CUDA-core FP32 (non-tensor)
    tf32_flops: float           # tensor-core TF32, dense
    bf16_flops: float           # tensor-core BF16, dense
    fp16_flops: float           # tensor-core FP16, dense
    fp8_flops: float            # tensor-core FP8, dense; 0.0 where the GPU has no FP8
    hbm_bandwidth: float        # B/s
    hbm_bytes: int              # capacity as the driver reports it (nvidia-smi MiB)
    nvlink_bandwidth: float     # B/s per GPU per direction
    pcie_bandwidth: float       # B/s per direction GPU<->NIC (PCIe switch on the board)
    nics_per_host: int          # default compute-fabric NICs in the reference host
    nic_gbps: float             # Gb/s per NIC
    max_gpus_per_host: int      # GPUs one NVLink/NVSwitch domain of the host holds
    sm_count: int
    source: tuple[str, ...]     # datasheets the numbers come from
    # how the run executes fp32 GEMMs: "ieee" (PyTorch's default) or "tf32" (tensor cores,
    # ``torch.backends.cuda.matmul.allow_tf32``). Not hardware: the plan's setting, which the
    # runner applies (backends/torch/precision.py), so that the prediction prices what runs.
    fp32_matmul: str = "ieee"

    def peak_flops(self, dtype: str) -> float:
        """Dense peak for a dtype name ('bf16', 'float32', 'fp8', ...).

        fp32 GEMMs run on TF32 tensor cores only if the user allows it
        (``torch.backends.cuda.matmul.allow_tf32``); pass 'tf32' for that case.
        """
        key = DTYPE_ALIASES.get(str(dtype).removeprefix("torch.").lower())
        if key is None:
            raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(set(DTYPE_ALIASES))}")
        value = getattr(self, f"{key}_flops")
        if value <= 0:  # no such tensor core (fp8 on A100): the op falls back to bf16
            return self.bf16_flops
        return value

    def gemm_dtype(self, dtype: str) -> str:
        """The dtype a GEMM of ``dtype`` runs at here: fp32 runs TF32 under ``fp32_matmul``
        "tf32" (why: the zoo's DLRM runs its fp32 sites with TF32 on and was priced at the
        CUDA-core fp32 peak, 62.5 ms predicted against 39.4 ms measured)."""
        if self.fp32_matmul == "tf32" and DTYPE_ALIASES.get(str(dtype).lower()) == "fp32":
            return "tf32"
        return dtype

    @property
    def usable_hbm_bytes(self) -> int:
        """What a training process can allocate: capacity minus CUDA context, NCCL and
        cuBLAS workspaces (~2.5 GiB observed on Hopper with NCCL initialised)."""
        return self.hbm_bytes - int(2.5 * 1024 * MIB)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "long_name": self.long_name,
            "fp32_flops": self.fp32_flops,
            "tf32_flops": self.tf32_flops,
            "bf16_flops": self.bf16_flops,
            "fp16_flops": self.fp16_flops,
            "fp8_flops": self.fp8_flops,
            "hbm_bandwidth": self.hbm_bandwidth,
            "hbm_bytes": self.hbm_bytes,
            "nvlink_bandwidth": self.nvlink_bandwidth,
            "source": list(self.source),
        }


DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8",
}

_A100_SOURCE = (
    "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): FP32 19.5 TF, TF32 156 TF, "
    "BF16/FP16 312 TF dense, HBM2e 2,039 GB/s, NVLink 600 GB/s bidirectional",
    "NVIDIA DGX A100 datasheet: 8x ConnectX-6 200 Gb/s HDR InfiniBand compute NICs",
)
_H100_SOURCE = (
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): FP32 67 TF, TF32 989 TF / BF16 1,979 TF"
    " / FP8 3,958 TF with sparsity (dense is half), HBM3 3.35 TB/s, NVLink 900 GB/s",
    "NVIDIA DGX H100 datasheet: 8x ConnectX-7 400 Gb/s compute NICs, rail-optimized fabric",
)
_H200_SOURCE = (
    "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): 141 GB HBM3e at 4.8 TB/s; FP32 67 TF, "
    "TF32 989 TF / BF16 1,979 TF / FP8 3,958 TF with sparsity (dense is half); "
    "NVLink 900 GB/s",
    "NVIDIA DGX H200 datasheet: 8x ConnectX-7 400 Gb/s compute NICs",
    "nvidia-smi on H200 SXM reports 143771 MiB",
)
_B200_SOURCE = (
    "NVIDIA HGX B200 datasheet (8 GPUs): FP32 600 TF, TF32 18 PF / BF16 36 PF / FP8 72 PF "
    "with sparsity (per GPU dense: 75 TF, 1.125 PF, 2.25 PF, 4.5 PF), HBM3e 8 TB/s per GPU, "
    "NVLink 5 1.8 TB/s per GPU bidirectional",
    "NVIDIA DGX B200 datasheet: 1,440 GB total GPU memory (180 GB per GPU), "
    "8x ConnectX-7 400 Gb/s compute NICs",
)

GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        GPUSpec(
            name="a100", long_name="NVIDIA A100 SXM 80GB",
            fp32_flops=19.5 * TERA, tf32_flops=156 * TERA, bf16_flops=312 * TERA,
            fp16_flops=312 * TERA, fp8_flops=0.0,
            hbm_bandwidth=2039 * GB, hbm_bytes=81920 * MIB,
            nvlink_bandwidth=300 * GB, pcie_bandwidth=32 * GB,  # PCIe Gen4 x16
            nics_per_host=8, nic_gbps=200, max_gpus_per_host=8, sm_count=108,
            source=_A100_SOURCE,
        ),
        GPUSpec(
            name="h100", long_name="NVIDIA H100 SXM 80GB",
            fp32_flops=67 * TERA, tf32_flops=494.5 * TERA, bf16_flops=989.5 * TERA,
            fp16_flops=989.5 * TERA, fp8_flops=1979 * TERA,
            hbm_bandwidth=3350 * GB, hbm_bytes=81559 * MIB,
            nvlink_bandwidth=450 * GB, pcie_bandwidth=64 * GB,  # PCIe Gen5 x16
            nics_per_host=8, nic_gbps=400, max_gpus_per_host=8, sm_count=132,
            source=_H100_SOURCE,
        ),
        GPUSpec(
            name="h200", long_name="NVIDIA H200 SXM 141GB",
            fp32_flops=67 * TERA, tf32_flops=494.5 * TERA, bf16_flops=989.5 * TERA,
            fp16_flops=989.5 * TERA, fp8_flops=1979 * TERA,
            hbm_bandwidth=4800 * GB, hbm_bytes=143771 * MIB,
            nvlink_bandwidth=450 * GB, pcie_bandwidth=64 * GB,
            nics_per_host=8, nic_gbps=400, max_gpus_per_host=8, sm_count=132,
            source=_H200_SOURCE,
        ),
        GPUSpec(
            name="b200", long_name="NVIDIA B200 (HGX B200)",
            fp32_flops=75 * TERA, tf32_flops=1125 * TERA, bf16_flops=2250 * TERA,
            fp16_flops=2250 * TERA, fp8_flops=4500 * TERA,
            hbm_bandwidth=8000 * GB, hbm_bytes=180 * 1000 * MIB,
            nvlink_bandwidth=900 * GB, pcie_bandwidth=64 * GB,
            nics_per_host=8, nic_gbps=400, max_gpus_per_host=8, sm_count=148,
            source=_B200_SOURCE,
        ),
    )
}

# Names torch.cuda.get_device_name() returns, to map a calibrated device to a spec.
_DEVICE_NAME_HINTS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("b200", "b200"))


def get_gpu(name: str) -> GPUSpec:
    """The spec of a GPU by name, case-insensitive ('H200', 'h200', 'NVIDIA H200')."""
    key = str(name).strip().lower()
    if key in GPUS:
        return GPUS[key]
    if key.startswith("nvidia"):  # a device name as the driver reports it
        for hint, spec_name in _DEVICE_NAME_HINTS:
            if re.search(rf"\b{hint}\b", key):
                return GPUS[spec_name]
    raise TopologyError(
        f"unknown GPU {name!r}",
        where="gpu",
        fix=f"use one of: {', '.join(sorted(GPUS))} (case-insensitive)",
    )


def gpu_from_device_name(device_name: str) -> GPUSpec | None:
    """Best match for ``torch.cuda.get_device_name()``, or None for an unknown GPU."""
    try:
        return get_gpu(device_name)
    except TopologyError:
        return None
