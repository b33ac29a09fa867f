"""One GPU table: memory as the driver reports it, and, for the GPUs convert's cost model knows,
the sustained rates it assumes. `quantkit plan` reads the memory; the budgets read the rates."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    mem_gib: float  # total memory as nvidia-smi / rocm-smi report it, GiB
    note: str  # where the figure comes from
    flops: float | None = None  # sustained float32 matmul FLOP/s (no TF32) convert's cost model assumes
    disk: float | None = None  # bytes/s read or written (NVMe)
    launch: float | None = None  # seconds per small kernel launch (GPTQ's column loop is launch bound)
    hbm: float | None = None  # bytes/s of device memory (data sheet): what a pass that streams the weights costs


# GPU memory as the driver reports it (nvidia-smi / rocm-smi total), in GiB. The marketing "GB"
# is looser: an H200 sold as 141 GB reports 143771 MiB = 140.4 GiB. Rates: float32 matmul at 50%
# of the data sheet; NVMe at 2 GB/s; GPTQ's per-column step is ~12 small kernels, launch bound.
# Memory bandwidth: the data sheet's figure (H200 4.8 TB/s, H100 SXM 3.35, B200 8).
GPUS: dict[str, GPU] = {
    "h200": GPU(140.4, "H200 141 GB: nvidia-smi 143771 MiB", flops=0.5 * 67e12, disk=2.0e9, launch=8e-6,
                hbm=4.8e12),
    "h100": GPU(79.6, "H100 SXM 80 GB: nvidia-smi 81559 MiB", flops=0.5 * 67e12, disk=2.0e9, launch=8e-6,
                hbm=3.35e12),
    "h100-nvl": GPU(93.6, "H100 NVL 94 GB: nvidia-smi 95830 MiB"),
    "h20": GPU(95.6, "H20 96 GB: nvidia-smi 97871 MiB"),
    "a100-80": GPU(80.0, "A100 80 GB: nvidia-smi 81920 MiB"),
    "b200": GPU(179.1, "B200 ~180 GB: nvidia-smi 183359 MiB (approximate)", flops=0.5 * 80e12, disk=2.0e9,
                launch=8e-6, hbm=8.0e12),
    "b300": GPU(268.0, "B300 288 GB spec (decimal), approximate"),
    "mi300x": GPU(191.7, "MI300X 192 GB: rocm-smi 205822885888 B"),
    "mi325x": GPU(256.0, "MI325X 256 GB, approximate"),
    "mi355x": GPU(288.0, "MI355X 288 GB, approximate"),
}
