"""The memory budgets validate and convert run under, and what one layer of a model costs in them.

Shared by convert's cost estimate (quantkit.planner.cost, whose docstring gives the whole
memory and time accounting) and validate's expert chunking (quantkit.validation.pipeline): one
set of layer shapes, one GPU table (quantkit.planner.gpus) and the CPU, disk and interconnect
rates beside it, one parser for sizes such as 8GB.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from quantkit.errors import ConfigError
from quantkit.planner.gpus import GPUS
from quantkit.runtime.machine import available_host_memory
from quantkit.runtime.units import GB, GiB

F32 = 4

# The process before the first tensor: torch, quantkit and safetensors are 238 MiB after import (266 MiB at
# the peak of a tiny RTN convert), but a convert's measured peaks at large calibration sit 0.1-0.2 GB above
# the terms modeled here (the tiny GLM at 512 x 512: GPTQ 0.77 GB, AWQ 1.07, against 0.66 and 0.89 with a
# 0.28 GB base), so the base is sized there: 0.40 GB, which over-predicts small runs (the bench classes at
# 32 x 64, peaks of 0.27-0.6 GB: 0.68-0.87 of the prediction), the safe side for a budget. A calibration
# that tokenizes text (a text file, a dataset) also imports transformers and a fast tokenizer: 238 MiB
# more, measured (datasets adds 24 MiB).
BASE_BYTES = int(0.40 * GB)
TOKENIZER_BYTES = int(0.25 * GB)
CHUNK_MAX = 16  # experts per chunk at most (one GPTQ batch) on the CPU
# On a GPU, GPTQ's column loop is launch-bound (LAUNCHES_PER_COLUMN small kernels per column,
# whatever the batch), so a larger batch of experts per call costs launches once for all of them.
CHUNK_MAX_GPU = 64

# GPU: float32 (no TF32) matmul at 50% of the data sheet; NVMe at 2 GB/s; GPTQ's per-column step
# is ~12 small kernels, launch bound.
# The GPUs convert's cost model has rates for, as the cost model reads them (a view of GPUS).
GPU_SPECS: dict[str, dict[str, float]] = {
    name: {"flops": g.flops, "mem_gib": g.mem_gib, "disk": g.disk, "launch": g.launch}
    for name, g in GPUS.items() if g.flops is not None
}

# The other sustained rates convert's cost model (quantkit.planner.cost) assumes, beside the GPUs'.
# CPU: float32 matmul per torch thread, in CPU time, on the 2-core AMD EPYC test machine
# (2048x6144 @ 6144x2048 and 6144x4096 @ 4096x6144: 104-105 GFLOP/s as scripts/bench_realshape.py
# prints it); times torch's threads. Wall time on a shared machine is longer by the load.
CPU_FLOPS_PER_THREAD = 95e9
# GPTQ's column loop on the CPU (rank-1 updates within each block, per-column quantization) runs
# at a fraction of the matmul rate: 0.4, fitted to the real-shape GLM runs at 8x512 and 32x512
# tokens and checked on the real-shape Kimi ones (docs/benchmarks.md).
CPU_GPTQ_EFFICIENCY = 0.4
CPU_DISK = 1.0e9  # bytes/s read or written
# the multi-rank exchange (quantkit.runtime.distributed): NCCL over NVLink at a conservative share of its
# 450 GB/s per direction for broadcasts; gloo over loopback TCP on one host
NVLINK_BYTES = 100e9
GLOO_BYTES = 1.0e9
LAUNCHES_PER_COLUMN = 12


def parse_bytes(v: int | float | str | None, what: str) -> int | None:
    """8GB, 8 GiB, 512MB, 8e9 or a number of bytes."""
    if v is None or isinstance(v, (int, float)):
        return None if v is None else int(v)
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*", str(v))
    if not m:
        raise ConfigError(f"{what} {v!r}: write a size such as 8GB, 80GiB or 512MB")
    unit = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    if m.group(3):
        unit = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * unit)


def device_memory(device: str, gpu: str | None) -> int | None:
    if device != "cuda":
        return None
    if gpu in GPU_SPECS:
        return int(GPU_SPECS[gpu]["mem_gib"] * GiB)
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return int(GPU_SPECS["h200"]["mem_gib"] * GiB)


@dataclass
class LayerShapes:
    """What the cost depends on, per model (from the architecture, as quantkit.planner.capacity lists it)."""

    hidden: int
    expert_width: int
    experts: int
    topk: int
    heads: int
    qk_head: int
    v_head: int
    max_dense_width: int  # the widest MLP a micro-batch runs (dense MLP or shared expert)
    dense_width: int  # a dense layer's MLP width (0 without one)
    shared_width: int  # a MoE layer's shared experts' width (0 without them)
    layer_params: int  # the largest layer's parameters other than routed experts
    dense_layer_params: int  # the largest dense layer's parameters (0 without one)
    moe_layer_params: int  # the largest MoE layer's parameters other than routed experts
    largest_tensor: int  # parameters of the largest single tensor (dequantized at once)
    moe_layers: int  # MoE layers, MTP included (they are all written)
    layers: int  # decoder layers, MTP included
    calibrated_layers: int  # decoder layers the calibration pass runs (and the first MTP layer; a further one is RTN)
    calibrated_moe_layers: int
    attn_params: int  # attention parameters of one layer (for time)
    index_heads: int
    index_topk: int
    has_dsa: bool


def layer_shapes(arch) -> LayerShapes:
    from quantkit.model.inventory import layer_of, tensor_inventory
    from quantkit.model.tensors import TensorClass

    a = arch
    per_layer: dict[int, int] = {}
    largest = 0
    attn = 0
    for s in tensor_inventory(a):
        L = layer_of(s.name)
        if L < 0 or s.klass == TensorClass.ROUTED_EXPERT:
            continue
        per_layer[L] = per_layer.get(L, 0) + s.params
        largest = max(largest, math.prod(s.shape))
        if L == 0 and s.klass.value in ("attention", "indexer"):
            attn += s.params
    return LayerShapes(
        hidden=a.hidden_size, expert_width=a.moe_intermediate_size, experts=a.n_routed_experts,
        topk=a.num_experts_per_tok, heads=a.num_attention_heads, qk_head=a.qk_head_dim, v_head=a.v_head_dim,
        max_dense_width=max(a.intermediate_size if not all(a.is_moe(i) for i in range(a.num_hidden_layers)) else 0,
                            a.moe_intermediate_size * max(a.n_shared_experts, 1)),
        layer_params=max(per_layer.values()), largest_tensor=largest,
        dense_layer_params=max([v for L, v in per_layer.items() if not a.is_moe(L)], default=0),
        moe_layer_params=max([v for L, v in per_layer.items() if a.is_moe(L)], default=0),
        dense_width=a.intermediate_size if not all(a.is_moe(i) for i in range(a.num_hidden_layers)) else 0,
        shared_width=a.moe_intermediate_size * a.n_shared_experts,
        moe_layers=sum(a.is_moe(i) for i in range(a.num_layers_with_mtp)), layers=a.num_layers_with_mtp,
        calibrated_layers=a.num_hidden_layers + min(a.num_mtp_layers, 1),
        calibrated_moe_layers=sum(a.is_moe(i) for i in range(a.num_hidden_layers + min(a.num_mtp_layers, 1))),
        attn_params=attn, index_heads=a.index_n_heads if a.has_dsa else 0,
        index_topk=a.index_topk if a.has_dsa else 0, has_dsa=a.has_dsa)


def expert_flops(D: int, I: int) -> tuple[float, float]:
    """(FLOPs per routed token, FLOPs per expert) of one routed expert's calibrated quantization,
    hidden D, expert width I: the Hessians grow with its tokens (gate/up's D x D, the quantized
    gate/up run on them, down's I x I); GPTQ's lazy updates and the two factorizations do not."""
    per_token = 2 * D * D + 2 * 2 * I * D + 2 * I * I
    per_expert = 2 * (2 * I) * D * D + 2 * D * I * I + (D**3 + I**3)
    return per_token, per_expert


def expert_fixed_tokens(arch) -> float:
    """An expert's GPTQ work in routed tokens' worth of Hessian work: the constant that
    quantkit.runtime.distributed.partition adds to each expert's token count when it balances ranks."""
    per_token, per_expert = expert_flops(arch.hidden_size, arch.moe_intermediate_size)
    return per_expert / per_token


def validate_budget(device: str, max_host_memory=None, max_gpu_memory=None, ranks_here: int = 1) -> int:
    """The memory one validate process computes in: the GPU's (or --max-gpu-memory), else the
    host's (--max-host-memory, per rank; by default the available memory shared by the ranks on
    this machine)."""
    if device == "cuda":
        return parse_bytes(max_gpu_memory, "--max-gpu-memory") or device_memory(device, None)
    return parse_bytes(max_host_memory, "--max-host-memory") or available_host_memory() // max(ranks_here, 1)


def validate_working_set(arch, device: str) -> tuple[int, int]:
    """(fixed, per routed expert) bytes of validate's layer loop: the process, the largest layer's
    other weights and their load transient; two float32 copies per expert (the dequantized
    weights and the dequantization's transient)."""
    x = layer_shapes(arch)
    fixed = (0 if device == "cuda" else BASE_BYTES) + x.layer_params * F32 + 3 * x.largest_tensor * F32
    return fixed, 2 * 3 * x.expert_width * x.hidden * F32


def validate_exchange(arch, tokens: int, nproc: int) -> int:
    """Bytes of routed-expert output rows a validate rank holds in the prompt pass with several
    ranks (quantkit.validation.layerstream: every expert's weighted rows, float32, top-k per token), for the
    most streams a pass runs: reference, prefill and decode, and two FP8-KV variants of the last two."""
    return (3 + 2 * 2) * tokens * arch.num_experts_per_tok * arch.hidden_size * F32 if nproc > 1 else 0


def validate_room(arch, device: str, budget: int, exchange: int = 0, long_len: int = 0) -> int:
    """Bytes left for resident weights (quantkit.validation.pipeline): the budget less the layer loop's
    working set at one expert per chunk, with several ranks the routed rows exchanged, and with a
    long-context pass of `long_len` tokens whichever needs more: the short passes' working set, or the
    long window's (its streams' hidden states beside the layer's weights, then the largest of the
    weights' load transient, one expert chunk and one stream's attention step: they come one after
    another, never together)."""
    fixed, per = validate_working_set(arch, device)
    need = fixed + per
    if long_len:
        load = 3 * layer_shapes(arch).largest_tensor * F32  # in `fixed`: the transient of loading a tensor
        hidden, step = long_pass_terms(arch, long_len)
        need = max(need, fixed - load + hidden + max(load, per, step))
    return budget - need - exchange


def prompt_pass_bytes(arch, tokens: int, streams: int) -> int:
    """The least validate's prompt pass holds whatever else it keeps: every eval window's hidden
    states, the normed MoE input, the expert output and the next hidden states of each of `streams`
    checkpoints, all windows at once (quantkit.validation.measure), float32: long_pass_terms' held
    bytes over all `tokens`."""
    return long_pass_terms(arch, tokens, streams)[0]


def long_pass_terms(arch, n: int, streams: int = 4) -> tuple[int, int]:
    """(held, step) float32 bytes of validate's long-context pass over one window of `n` tokens
    (quantkit.validation.longctx, one window at a time). Held through a layer, per stream (reference,
    prefill, decode, decode's FP8-KV variant): the hidden states, the normed MoE input, the expert output
    and the next hidden states (quantkit.validation.layerstream). One stream's attention step: q and k at
    qk_head_dim, the key/value projection's output, the attention output and its transpose, per head, and three score
    chunks (scores, masked, probabilities; at most quantkit.model.ops.SCORE_CHUNK_BYTES each)."""
    from quantkit.model.ops import SCORE_CHUNK_BYTES

    held = streams * 4 * n * arch.hidden_size * F32
    per_head = 3 * (arch.qk_head_dim + arch.v_head_dim)  # q, k; the key/value projection's output (at most qk + v); out x2
    scores = min(SCORE_CHUNK_BYTES, max(arch.num_attention_heads, arch.index_n_heads or 0) * n * n * F32)  # one chunk's
    return held, n * arch.num_attention_heads * per_head * F32 + 3 * scores


def long_pass_bytes(arch, n: int, streams: int = 4) -> int:
    """Both terms of long_pass_terms together (0 without a long pass): what an expert chunk sized beside
    the long window leaves room for."""
    return sum(long_pass_terms(arch, n, streams)) if n else 0


def validate_expert_chunk(arch, device: str, max_host_memory=None, max_gpu_memory=None, *, kept: int = 0,
                          ranks_here: int = 1, exchange: int = 0) -> int:
    """Routed experts validate loads at once: what the budget leaves after the process, the
    largest layer's other weights and their load transient, the weights kept resident (`kept`)
    and the exchanged rows, at two float32 copies per expert, 1 to CHUNK_MAX."""
    budget = validate_budget(device, max_host_memory, max_gpu_memory, ranks_here)
    fixed, per = validate_working_set(arch, device)
    return int(min(max((budget - fixed - kept - exchange) // per, 1), CHUNK_MAX))


# ---- validate's long-context window (quantkit.validation.longctx runs it; the cost model sizes it)
LONG_SAMPLES = 2  # long windows measured (at most validate's num_samples): each costs long_len / seq_len short ones


def long_len(arch, requested: int | None, folder) -> int:
    """The long window's length: `requested` (0: no long-context rows), else 2 x index_topk bounded by
    max_position_embeddings; 0 for a model without a DSA indexer."""
    if not arch.has_dsa or requested == 0:
        return 0
    topk, max_pos = arch.index_topk, arch.max_position_embeddings
    if requested is None:
        n = min(2 * topk, max_pos)
        return n if n > topk else 0
    if not isinstance(requested, int) or requested < 0:
        raise ConfigError(f"--long-context: must be an integer >= 0 (got {requested!r})")
    if requested > max_pos:
        raise ConfigError(f"--long-context {requested}: longer than max_position_embeddings {max_pos} in "
                          f"{folder}/config.json; pass --long-context <= {max_pos} (or 0 to skip the long-context rows)")
    if requested <= topk:
        raise ConfigError(f"--long-context {requested}: not past index_topk {topk} in {folder}/config.json, where DSA "
                          f"equals dense attention; pass --long-context > {topk} (default {min(2 * topk, max_pos)})")
    return requested
