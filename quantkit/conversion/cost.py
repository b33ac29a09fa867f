"""What a conversion will cost, computed before it starts: memory, disk, time; and the settings that
keep it inside a memory budget.

`convert` calls `plan_convert` to size its activation store, micro-batches, expert chunks and
output shards, prints the result, and refuses to start when even the smallest settings exceed
the budget; `quantkit plan MODEL --convert` prints the same object for a model that is not on
disk. One function for both, so the prediction is the engine's own accounting.

Memory, in bytes (D hidden, I expert width, N x T calibration tokens, k experts per token,
C experts per chunk, B samples per micro-batch, w = 4 bytes per float32; compute is float32):

    base          the Python process with torch and quantkit imported (measured, BASE_BYTES)
    writer        the two output writers' buffers: one layer's tensors, up to a shard each, and
                  as much again for the part being saved in the background (safetensors 0.8
                  writes from the tensors' memory, no serialized copy)
    dense_layer,  a dense layer's weights, and a MoE layer's weights other than its routed
    moe_layer     experts, float32
    load_transient dequantizing the largest tensor: 3 float32 copies (values, scales, product);
                  the source itself costs nothing beyond that: it is read with positioned reads
                  into memory freed with each tensor, not memory-mapped (quantkit.checkpoint.shards)
    store         h and x for every calibration token: 2 N T D bytes-per-element (MoE layers)
                  (0 in RAM when disk-backed)
    routing       top-k ids (int16) and weights (float32): 6 N T k
    attention     one micro-batch: B T tokens x (hidden-wide and head-wide activations) plus
                  3 B heads T^2 w for scores, masked scores and probabilities
    experts       C x max(7 I D w + D^2 w, 5 I D w + 2 I D + 2 D^2 w): source weights (kept for
                  the held-out guard), the row-stacked gate/up and, during GPTQ, H being factored
                  and its factor; plus each expert's held-out rows (1/8 of its routed tokens), one
                  micro-batch's gathered rows and down inputs, and the all-token H.
                  AWQ gathers instead: the layer's MoE inputs (N T D w) and, per expert, its
                  routed rows n = N T k / E as inputs, outputs and down inputs (n (2D + 2I) w)

    peak = base + writer + store + routing + max(attention phase, experts phase)
    attention phase = max over dense/MoE layers of (layer weights + max(load_transient, attention))
    experts phase   = moe_layer + experts

On a GPU, layer/store/routing/attention/experts are device memory, base/writer and the source's
pages host memory (plus the store when it lives in pinned host memory).

Several ranks (`nproc`, quantkit.runtime.distributed: torchrun, one rank per GPU): every figure is per
rank. The routed experts' Hessians and GPTQ are split by experts (balanced by routed tokens, so
divided by nproc); attention and the routed-expert outputs by micro-batches (the busiest rank's
share of them, `token_share`); the rest is done by every rank. Memory adds `received`, every INT4
expert of a layer quantized (int8 q + bf16 scales), which each rank holds between the exchange and
the h update (every rank still holds the whole store); time adds `exchange`, broadcasting them,
and `gather`, giving every rank the micro-batches' h, x and routing the others computed.

Time is FLOPs over a sustained rate per device (CPU_FLOPS_PER_THREAD measured on the 2-core test
machine, GPTQ's column loop at CPU_GPTQ_EFFICIENCY of it; GPU rates from the data sheet at the
efficiency stated in GPU_SPECS), bytes over disk bandwidth, and a per-column kernel-launch cost for
GPTQ's column loop on a GPU. The disk works while the layers compute (the next layer is read ahead,
cut parts are saved in the background): the run pays the first layer's read, the last layer's
write, `disk_wait` when reads and writes together need longer than the compute, and
`resume_state`, rank 0 saving h for --resume every `state_every` layers (STATE_OVERHEAD). Validate:
each rank's share of the three checkpoints as stored, what of it fits in memory (kept), the reads
(all once, then per greedy token what was not kept) and the compute. `rates` sets what-ifs
(`--disk-gbps`). It is an estimate; docs/benchmarks.md compares it with measurements.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from quantkit.conversion.activations import StorePlan
from quantkit.errors import ConfigError
from quantkit.planner.budgets import (  # noqa: F401  (GB, parse_bytes, expert_fixed_tokens: re-exported for plan --convert)
    BASE_BYTES,
    CHUNK_MAX,
    F32,
    GB,
    GPU_SPECS,
    GiB,
    LayerShapes,
    device_memory,
    expert_fixed_tokens,
    expert_flops,
    layer_shapes,
    parse_bytes,
    validate_exchange,
    validate_room,
)
from quantkit.runtime.machine import available_host_memory, peak_rss  # noqa: F401

MIN_SHARD = 256 * 2**20
# convert's resume state holds h for every calibration token (26 GB for GLM 5.2's shipped recipe in
# float32: 13 s at 2 GB/s); it is saved every `state_every` layers, as many as keep its writing
# under this fraction of the run (ConvertCost.state_every)
STATE_OVERHEAD = 0.05
# On a GPU, GPTQ's column loop is launch-bound (LAUNCHES_PER_COLUMN small kernels per column,
# whatever the batch), so a larger batch of experts per call costs launches once for all of them.
CHUNK_MAX_GPU = 64

# Sustained rates. CPU: float32 matmul per torch thread, in CPU time, on the 2-core AMD EPYC test
# machine (2048x6144 @ 6144x2048 and 6144x4096 @ 4096x6144: 104-105 GFLOP/s as scripts/bench_realshape.py
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


@dataclass
class ConvertCost:
    """A conversion's predicted cost and the settings chosen to keep to the budget."""

    device: str
    gpu: str | None
    host_budget: int
    gpu_budget: int | None
    tokens: int
    store: StorePlan
    expert_chunk: int
    shard_bytes: int
    memory: dict[str, int]  # component -> bytes (see the module docstring)
    peak_host: int
    peak_device: int | None
    disk: dict[str, int]
    seconds: dict[str, float]  # phase -> seconds
    validate_seconds: float | None
    validate_share: int | None = None  # bytes of the three checkpoints one rank reads (its experts only), as stored
    validate_kept: int | None = None  # of which validate keeps in memory (device, then host); the rest is re-read per pass
    state_every: int = 1  # convert saves its resume state after every this many layers (STATE_OVERHEAD)
    notes: list[str] = field(default_factory=list)
    fits: bool = True
    reason: str = ""
    nproc: int = 1  # ranks (quantkit.runtime.distributed); memory and time are per rank, all ranks in parallel

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["store"] = {"dtype": str(self.store.dtype).removeprefix("torch."), "backing": self.store.backing,
                      "location": self.store.location, "micro_batch": self.store.micro_batch}
        d["seconds_total"] = round(sum(self.seconds.values()), 1)
        return d

    def summary(self) -> str:
        s = self.store
        dev = f", peak device {self.peak_device / GB:.2f} GB of {self.gpu_budget / GB:.1f}" if self.peak_device else ""
        where = "disk" if s.backing == "disk" else ("device" if s.location == "device" and self.device != "cpu" else "host")
        ranks = f" per rank ({self.nproc} ranks)" if self.nproc > 1 else ""
        lines = [
            f"predicted{ranks}: peak host {self.peak_host / GB:.2f} GB of {self.host_budget / GB:.1f} GB budget{dev}; "
            f"time {_hms(sum(self.seconds.values()))} ("
            + ", ".join(f"{k} {_hms(v)}" for k, v in self.seconds.items()) + ")",
            f"  activations: {self.tokens} tokens in {str(s.dtype).removeprefix('torch.')} on {where}, "
            f"{s.micro_batch} samples per micro-batch; {self.expert_chunk} experts per chunk; "
            f"shards {self.shard_bytes / GB:.2f} GB; disk {sum(self.disk.values()) / GB:.2f} GB "
            f"(prefill {self.disk['prefill'] / GB:.2f}, decode {self.disk['decode'] / GB:.2f}, "
            f"resume state {self.disk['resume_state'] / GB:.2f})",
        ]
        if self.validate_seconds is not None:
            lines.append(f"  validate: about {_hms(self.validate_seconds)}; the checkpoints' share{' per rank' if ranks else ''} "
                         f"{self.validate_share / GB:.1f} GB as stored, {self.validate_kept / GB:.1f} GB of it kept in memory")
        lines += [f"  note: {n}" for n in self.notes]
        if not self.fits:
            lines.append(f"  does not fit: {self.reason}")
        return "\n".join(lines)


def _hms(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _attention_bytes(x: LayerShapes, B: int, T: int) -> int:
    n = B * T
    act = n * F32 * (6 * x.hidden + 3 * x.heads * x.qk_head + 3 * x.heads * x.v_head + 3 * x.max_dense_width)
    scores = 3 * B * x.heads * T * T * F32
    if x.has_dsa and T > x.index_topk:
        scores += B * T * T * (x.index_heads * F32 + 1 + 8)
    return act + scores


def _per_expert(x: LayerShapes, tokens: int = 0) -> int:
    """One expert of a chunk at its peak: stacking gate/up (source weights, the per-expert cats and
    the stack) with H, or GPTQ (source weights kept for the guard, the stacked weight, q, and H
    being factored plus its factor); plus its held-out rows for the guard."""
    D, I = x.hidden, x.expert_width
    held = tokens * x.topk // max(x.experts, 1) // 8 * D * F32
    return max(7 * I * D * F32 + D * D * F32, 5 * I * D * F32 + 2 * I * D + 2 * D * D * F32) + held


def _awq_per_expert(x: LayerShapes, tokens: int) -> int:
    """One expert of an AWQ chunk: GPTQ's work on the smoothed weights (`_per_expert`), plus the
    search's per-expert rows, gathered whole (quantkit.quant.awq.quantize_experts_awq): its fit inputs
    and the float expert's outputs (n x D each), down's input before and after quantization
    (n x I each), and the s = 1 alternative's dequantized weights kept for the guard."""
    D, I = x.hidden, x.expert_width
    n = tokens * x.topk // max(x.experts, 1)
    return _per_expert(x, tokens) + n * F32 * (2 * D + 2 * I) + 3 * I * D * F32


def _expert_mb_bytes(x: LayerShapes, B: int, T: int) -> int:
    n = B * T
    return n * F32 * (3 * x.hidden + 3 * x.expert_width) + x.hidden * x.hidden * F32  # + all-token H


def state_every(save_s: float, layer_s: float) -> int:
    """Layers between two saves of convert's resume state: 1 when a save takes under a second
    (nothing worth saving there, and a crash then loses the least), else the fewest that keep a
    save (save_s) under STATE_OVERHEAD of the compute in between (layer_s per layer). Convert saves
    after the embeddings, after every `state_every`-th layer and after the last one."""
    if save_s < 1.0:
        return 1
    return max(1, math.ceil(save_s / STATE_OVERHEAD / max(layer_s, 1e-9)))


def token_share(N: int, B: int, nproc: int) -> float:
    """The busiest rank's fraction of the calibration tokens under the token split: micro-batch i
    (B samples) is rank i % nproc's (quantkit.runtime.distributed.Group.batch_owner), so with fewer
    micro-batches than ranks some ranks idle and the split is by micro-batches, not by nproc."""
    n_batches = max(math.ceil(N / max(B, 1)), 1)
    return math.ceil(n_batches / nproc) / n_batches


def gather_bytes(x: LayerShapes, N: int, T: int, dtype: torch.dtype, nproc: int) -> float:
    """Bytes each rank receives over the whole run to hold the full store again after the token
    split: per calibrated layer h (every layer) and, for a MoE layer, x and the routing (6 B per
    top-k slot), plus the DSA selections (int64 per kept index) when seq_len > index_topk; each
    rank already has 1/nproc of it."""
    tokens, w = N * T, (4 if dtype == torch.float32 else 2)
    L, Lm = x.calibrated_layers, x.calibrated_moe_layers
    per_run = tokens * x.hidden * w * L + tokens * (x.hidden * w + 6 * x.topk) * Lm
    if x.has_dsa and T > x.index_topk:
        per_run += tokens * x.index_topk * 8 * L
    return per_run * (nproc - 1) / nproc


def plan_convert(
    arch,
    *,
    method: str,
    group_size: int,
    num_samples: int,
    seq_len: int,
    calibrate: bool,
    device: str = "cpu",
    gpu: str | None = None,
    max_host_memory: int | str | None = None,
    max_gpu_memory: int | str | None = None,
    source_bytes: int,
    output_bytes: tuple[int, int],
    max_shard_bytes: int = 5 * GiB,
    validate=None,
    activation_dtype: str | None = None,
    quantized: float = 1.0,
    nproc: int = 1,
    expert_bytes: int | None = None,
    rates: dict[str, float] | None = None,
) -> ConvertCost:
    """Settings and predicted cost of converting `arch` (see the module docstring for the terms).

    quantized: the fraction of the calibrated layers' routed experts that decode stores as new INT4
    (Hessians and GPTQ run only for those; 0 when every expert is the source's reused INT4).

    output_bytes: (prefill, decode) sizes; validate: the recipe's validate section, or None;
    activation_dtype: "float32" or "bfloat16" to force the store's dtype (default: the budget's choice).
    nproc: ranks of a multi-rank convert (quantkit.runtime.distributed): memory and time per rank.
    expert_bytes: the routed experts' bytes in the source and both outputs (validate splits them
    across ranks); default 95% of the three.
    rates: what-ifs over the device's sustained rates, {"flops": matmul FLOP/s, "disk": bytes/s}
    (`quantkit plan --convert --disk-gbps`; scripts/bench_*.py print the sensitivity).
    """
    rates = rates or {}
    x = layer_shapes(arch)
    host = parse_bytes(max_host_memory, "--max-host-memory") or available_host_memory()
    gpu_mem = parse_bytes(max_gpu_memory, "--max-gpu-memory") if device == "cuda" else None
    if device == "cuda" and gpu_mem is None:
        gpu_mem = device_memory(device, gpu)
    N, T = (num_samples, seq_len) if calibrate else (0, 0)
    tokens = N * T
    D = x.hidden
    on_gpu = device == "cuda"
    budget = gpu_mem if on_gpu else host  # where the compute work lives
    chunk_max = CHUNK_MAX_GPU if on_gpu else CHUNK_MAX

    w_dense, w_moe = x.dense_layer_params * F32, x.moe_layer_params * F32
    transient = 3 * x.largest_tensor * F32  # dequantizing one FP8 tensor: values, expanded scales, product
    shard = min(max_shard_bytes, max(MIN_SHARD, host // 16))
    n_layers = max(x.layers, 1)
    # the part being filled and the one being saved in the background (CheckpointWriter.MAX_PENDING), per output
    writer = 2 * sum(min(int(b / n_layers * 1.5), shard) for b in output_bytes)  # an expert-heavy layer's share
    routing = tokens * x.topk * 6
    host_fixed = BASE_BYTES + writer
    dev_fixed = (0 if on_gpu else host_fixed) + routing
    # multi-rank: a layer's INT4 experts, quantized (int8 q, bf16 scale per group), held by every rank
    # from the exchange to the end of the h update; taken from the room before the chunk is sized
    # (an expert's GPTQ bytes do not depend on its chunk, so the output stays the single-process one)
    E4 = round(quantized * x.experts)  # a layer's experts that are quantized: what ranks split and exchange
    shared_work = nproc > 1 and calibrate and method != "rtn" and E4 > 0
    received = E4 * 3 * x.expert_width * D * (1 + 2 / group_size) if shared_work else 0
    room = budget - dev_fixed - received
    notes: list[str] = []

    def phase_attention(B: int) -> int:
        """Loading a layer and running its attention half (and dense MLP / shared expert)."""
        att = _attention_bytes(x, B, T) if calibrate else 0
        return max(w_dense + max(transient, att), w_moe + max(transient, att))

    awq = calibrate and method == "awq"
    per_expert = _awq_per_expert(x, tokens) if awq else _per_expert(x, tokens)

    def phase_experts(B: int, C: int) -> int:
        """A MoE layer's routed experts, C at a time."""
        if not calibrate:
            return w_moe + C * 3 * x.expert_width * D * F32 * 2
        gathered = tokens * D * F32 if awq else 0  # AWQ's search reads the layer's x whole
        return w_moe + C * per_expert + _expert_mb_bytes(x, B, T) + gathered

    choice = None
    B = max(N, 1)
    if calibrate:
        while B > 1 and max(_attention_bytes(x, B, T), _expert_mb_bytes(x, B, T)) > 0.15 * room:
            B = (B + 1) // 2
        options = [(torch.float32, "memory"), (torch.bfloat16, "memory"), (torch.bfloat16, "disk")]
        if activation_dtype is not None:
            from quantkit.conversion.activations import STORE_DTYPES

            if activation_dtype not in STORE_DTYPES:
                raise ConfigError(f"activation dtype {activation_dtype!r}: use float32 or bfloat16")
            forced = STORE_DTYPES[activation_dtype]
            options = [(forced, "memory"), (forced, "disk")]
        fallback = None
        for dt, backing in options:
            store_b = 2 * tokens * D * (4 if dt == torch.float32 else 2) if backing == "memory" else 0
            if on_gpu and backing == "memory" and store_b > 0.5 * room:  # on a GPU: try pinned host memory
                location = "host" if store_b < 0.7 * (host - host_fixed) else None
            else:
                location = "device"
            if location is None:
                continue
            left = room - (store_b if location == "device" else 0)
            if phase_attention(B) > left:
                continue
            C = int((left - phase_experts(B, 0)) // per_expert)
            C = max(min(C, chunk_max, x.experts), 0)
            cand = (dt, backing, location, C, store_b)
            if C >= min(4, x.experts):
                choice = cand
                break
            if C >= 1 and fallback is None:
                fallback = cand
        choice = choice or fallback
    else:
        C = int((room - phase_experts(1, 0)) // (3 * x.expert_width * D * F32 * 2))
        choice = (torch.float32, "memory", "device", max(min(C, chunk_max, x.experts), 0), 0)

    fits, reason = True, ""
    if choice is None or choice[3] < 1:
        fits = False
        need = dev_fixed + max(phase_attention(1), phase_experts(1, 1))
        knob = "--max-gpu-memory" if on_gpu else "--max-host-memory"
        reason = (f"{knob} {budget / GB:.1f} GB cannot hold one layer's work even with the activations on disk "
                  f"and one expert at a time (needs about {need / GB:.1f} GB): raise {knob}"
                  + (", or lower --seq-len (attention scores grow with its square)" if calibrate else ""))
        choice = choice or (torch.bfloat16, "disk", "device", 1, 0)
    dt, backing, location, C, store_b = choice
    C = max(C, 1)
    store = StorePlan(dtype=dt, backing=backing, location=location, micro_batch=min(B, max(N, 1)))
    work = max(phase_attention(B), phase_experts(B, C))

    memory = {"base": BASE_BYTES, "writer": writer, "store": store_b, "routing": routing,
              "dense_layer": w_dense, "moe_layer": w_moe, "load_transient": transient,
              "attention": _attention_bytes(x, B, T) if calibrate else 0,
              "experts": phase_experts(B, C) - w_moe, "work": work, "received": int(received)}
    if on_gpu:
        peak_device = (store_b if location == "device" else 0) + routing + work + received
        peak_host = host_fixed + (store_b if location == "host" else 0) + transient
    else:
        peak_device = None
        peak_host = host_fixed + store_b + routing + work + received
    if fits and received and (peak_device if on_gpu else peak_host) > budget:
        fits = False
        knob = "--max-gpu-memory" if on_gpu else "--max-host-memory"
        reason = (f"{nproc} ranks: each holds a layer's {E4} quantized experts ({received / GB:.1f} GB) on top of the "
                  f"single-process work; raise {knob} or use fewer ranks")
    if calibrate and store.dtype == torch.bfloat16 and activation_dtype is None:
        notes.append("hidden states stored in bfloat16 (float32 does not fit the budget)")
    if calibrate and x.has_dsa and T > x.index_topk:
        notes.append(f"seq_len {T} > index_topk {x.index_topk}: DSA selections are kept per micro-batch")

    state_bytes = tokens * D * (4 if dt == torch.float32 else 2)
    disk = {"prefill": output_bytes[0], "decode": output_bytes[1],
            "resume_state": state_bytes + (2 * state_bytes if backing == "disk" else 0),
            "streamed_source": 0}

    # ---- time
    if on_gpu:
        spec = GPU_SPECS.get(gpu or "h200", GPU_SPECS["h200"])
        flops, disk_bw, launch = spec["flops"], spec["disk"], spec["launch"]
    else:
        flops, disk_bw, launch = CPU_FLOPS_PER_THREAD * torch.get_num_threads(), CPU_DISK, 0.0
    flops, disk_bw = rates.get("flops", flops), rates.get("disk", disk_bw)
    if flops <= 0 or disk_bw <= 0:
        raise ConfigError(f"--disk-gbps {disk_bw / 1e9:g}, matmul {flops / 1e12:g} TFLOP/s: both must be positive")
    gptq_rate = flops * (1.0 if on_gpu else CPU_GPTQ_EFFICIENCY)
    I = x.expert_width
    L, Lm = x.calibrated_layers, x.calibrated_moe_layers  # the calibration pass skips MTP layers
    attn_flops = tokens * (2 * x.attn_params + 2 * 2 * x.heads * T * (x.qk_head + x.v_head)) * L
    attn_flops += tokens * 2 * 3 * D * (x.dense_width * (L - Lm) + x.shared_width * Lm)  # dense MLP / shared expert
    routed = tokens * x.topk  # token-expert pairs per MoE layer
    gptq_on = calibrate and method in ("gptq", "awq")
    # the experts that get Hessians and GPTQ (not the reused source INT4 ones), this rank's part of them
    share = quantized / (nproc if shared_work else 1)
    per_token_hess, per_expert_gptq = expert_flops(D, I)
    hess_flops = share * routed * per_token_hess * Lm if gptq_on else 0
    out_flops = routed * 2 * 3 * I * D * Lm if calibrate else 0
    gptq_flops = share * x.experts * Lm * per_expert_gptq if gptq_on else 0
    chunks = Lm * math.ceil(share * x.experts / C)
    gptq_launch = chunks * (D + I) * LAUNCHES_PER_COLUMN * launch if gptq_on else 0.0
    rtn_flops = x.experts * (x.moe_layers - (Lm if gptq_on else 0)) * 3 * I * D * 20  # RTN'd experts (MTP, or all)
    seconds = {
        "read": source_bytes / disk_bw,
        "attention": attn_flops / flops,
        "hessians": hess_flops / flops,
        "gptq": gptq_flops / gptq_rate + gptq_launch + rtn_flops / flops,
        "experts_out": out_flops / flops,
        "write": (output_bytes[0] + output_bytes[1]) / disk_bw,
    }
    link = NVLINK_BYTES if on_gpu else GLOO_BYTES
    if nproc > 1 and calibrate:  # the token split: each rank runs the per-token work of its own micro-batches
        share_tokens = token_share(N, store.micro_batch, nproc)
        seconds["attention"] *= share_tokens
        seconds["experts_out"] *= share_tokens
        seconds["gather"] = gather_bytes(x, N, T, store.dtype, nproc) / link
    if method == "awq" and calibrate:
        seconds["gptq"] *= 1.3  # AWQ's scale search on top (measured ~1.3x GPTQ on the tiny models)
        notes.append("awq: the search gathers the layer's MoE inputs and each expert's routed rows (budgeted); "
                     "time as GPTQ x 1.3")
    if shared_work:  # each rank receives the others' share of every layer's quantized experts
        seconds["exchange"] = received * (nproc - 1) / nproc * Lm / link
        notes.append(f"{nproc} ranks: attention and experts_out are split by micro-batches (then h, x and the "
                     "routing are gathered), hessians and gptq by experts (balanced by routed tokens); read is "
                     "done by every rank; write is spread over the ranks, at one disk's bandwidth "
                     "(docs/distributed.md)")
    elif nproc > 1 and calibrate:
        notes.append(f"{nproc} ranks: no expert is quantized here (reused source INT4), so only attention and "
                     "experts_out are split (by micro-batches); read and the rest are done by every rank "
                     "(docs/distributed.md)")
    elif nproc > 1:
        notes.append(f"{nproc} ranks: no calibration, so there is nothing to split: every rank repeats the whole "
                     "run; use one (docs/distributed.md)")

    compute = sum(v for k, v in seconds.items() if k not in ("read", "write"))
    # The disk works while the layers compute: the next layer is read ahead (conversion.Prefetcher)
    # and the cut parts are saved in the background (CheckpointWriter). Reading the first layer and
    # saving the last one's parts add to the run, and so does the time the disk (reads and writes
    # share it) needs beyond the compute's.
    io = seconds["read"] + seconds["write"]
    seconds["read"] /= max(x.layers, 1)
    seconds["write"] /= max(x.layers, 1)
    if io > compute:
        seconds["disk_wait"] = io - compute
    every = 1
    if state_bytes:  # rank 0 saves h for --resume every `every` layers (conversion.convert)
        save_s = state_bytes / disk_bw
        compute = sum(v for k, v in seconds.items() if k not in ("read", "write", "disk_wait"))
        every = state_every(save_s, compute / max(x.layers, 1))
        seconds["resume_state"] = (1 + math.ceil(x.layers / every)) * save_s

    validate_s = validate_share = validate_kept = None
    if validate is not None:
        # quantkit.validation.pipeline: every rank runs attention for all eval tokens and its share of the routed
        # experts (their output rows exchanged); it keeps its share of the three checkpoints resident,
        # as stored, when that fits beside the layer loop, else every pass re-reads the layers
        vt = validate.num_samples * validate.seq_len
        passes = max(validate.gen_tokens, 1)  # the prompt pass yields the first token; each further one is a pass
        three = source_bytes + output_bytes[0] + output_bytes[1]
        experts_b = three * 0.95 if expert_bytes is None else expert_bytes
        share = int(three - experts_b + experts_b / nproc)
        streams = 3  # the prompt pass: reference, prefill, decode
        exchange = validate_exchange(arch, vt, nproc)
        room = validate_room(arch, device, gpu_mem if on_gpu else host, exchange)
        if on_gpu:  # then the rank's host memory
            room = max(room, 0) + validate_room(arch, "cpu", host)
        validate_kept = int(min(share, max(room, 0)))
        # the first pass reads the three checkpoints; each further one what the ranks could not keep
        # (the routed experts: the shared tensors are kept first), from one disk
        again = min(three, nproc * (share - validate_kept))
        vflops = vt * 2 * (x.attn_params + 3 * x.topk * I * D / nproc) * x.layers * streams
        validate_s = (three + (passes - 1) * again) / disk_bw + vflops / flops
        validate_s += x.calibrated_moe_layers * exchange * (nproc - 1) / nproc / link
        validate_share = share
        if validate.gen_tokens and again:
            notes.append(f"validate: {validate_kept / GB:.0f} of a rank's {share / GB:.0f} GB share kept in memory, so each "
                         f"greedy token re-reads {again / GB:.0f} GB from disk ({validate.gen_tokens} tokens); more "
                         f"ranks or a larger budget keep it all (docs/distributed.md)")
    return ConvertCost(device=device, gpu=gpu if on_gpu else None, host_budget=host, gpu_budget=gpu_mem, tokens=tokens,
                       store=store, expert_chunk=C, shard_bytes=shard, memory=memory, peak_host=int(peak_host),
                       peak_device=int(peak_device) if peak_device is not None else None, disk=disk,
                       seconds={k: round(v, 1) for k, v in seconds.items()}, validate_seconds=validate_s,
                       validate_share=validate_share, validate_kept=validate_kept, state_every=every,
                       notes=notes, fits=fits, reason=reason, nproc=nproc)


def plan_convert_for(
    model: str,
    *,
    recipe: str | None = None,
    gpu: str = "h200",
    method: str | None = None,
    num_samples: int | None = None,
    seq_len: int | None = None,
    group_size: int | None = None,
    max_host_memory: int | str | None = None,
    max_gpu_memory: int | str | None = None,
    validate: bool = True,
    nproc: int = 1,
    rates: dict[str, float] | None = None,
) -> ConvertCost:
    """`quantkit plan MODEL --convert`: the cost `convert` would predict for MODEL (a preset, a
    folder, a tiny:/realshape: id or hf://org/repo@rev, headers only) with the recipe and overrides,
    on `gpu` (h200, h100, b200) or on the CPU (`cpu`); `nproc` ranks (one per GPU) split the experts."""
    from pathlib import Path

    from quantkit.model.arch import arch_from_config, load_preset, preset_names
    from quantkit.model.tensors import TensorClass
    from quantkit.recipe import default_recipe, load_recipe, recipe_overrides

    if gpu != "cpu" and gpu not in GPU_SPECS:
        raise ConfigError(f"--gpu {gpu!r}: choose one of {', '.join([*GPU_SPECS, 'cpu'])}")
    is_preset = model in preset_names() and not Path(model).is_dir()
    if is_preset:
        arch = arch_from_config(load_preset(model), source=f"preset {model}")
    else:
        from quantkit.inputs.modelspec import open_checkpoint

        ckpt = open_checkpoint(model)
        arch = ckpt.arch
    rec = load_recipe(recipe) if recipe is not None else default_recipe(str(model), arch)
    rec = recipe_overrides(rec, method=method, group_size=group_size, num_samples=num_samples, seq_len=seq_len)
    G = rec.group_size
    from quantkit.conversion.precision import predicted_bytes, source_int4_group

    sg = source_int4_group(arch)
    if is_preset:
        from quantkit.conversion.precision import source_int4_group
        from quantkit.planner.capacity import plan as size_plan

        sizes = size_plan(model, group_size=G).checkpoints
        source_bytes = sizes["source"].total_bytes
        out = (sizes["prefill"].total_bytes, sizes["decode"].total_bytes)
        expert_bytes = sum(sizes[k].bytes_by_class.get(TensorClass.ROUTED_EXPERT.value, 0)
                           for k in ("source", "prefill", "decode"))
        # the preset's experts are in the source's own format: reused when it is the target INT4 scheme
        quantized = 0.0 if (sg == G and rec.decode.reuse_source_int4) else 1.0
    else:
        from quantkit.conversion.precision import decide

        decisions = {n: decide(st, rec, G, sg) for n, st in ckpt.tensors.items()}
        source_bytes = sum(ckpt.storage_bytes(n) for n in ckpt.tensors)
        out = predicted_bytes(ckpt, decisions, G)
        routed = {n: d for n, d in decisions.items() if ckpt.tensors[n].info.klass == TensorClass.ROUTED_EXPERT}
        expert_bytes = sum(ckpt.storage_bytes(n) for n in routed) + sum(predicted_bytes(ckpt, routed, G))
        quantized = quantized_fraction(ckpt, decisions)
    # as convert: any calibrated method runs the calibration pass, even when every expert is reused,
    # because the FP8 KV-cache scales are measured on it (quantkit.model.kvcache)
    calibrate = rec.method != "rtn"
    device = "cpu" if gpu == "cpu" else "cuda"
    return plan_convert(arch, method=rec.method, group_size=G, num_samples=rec.calibration.num_samples,
                        seq_len=rec.calibration.seq_len, calibrate=calibrate, device=device,
                        gpu=None if gpu == "cpu" else gpu, max_host_memory=max_host_memory,
                        max_gpu_memory=max_gpu_memory, source_bytes=source_bytes, output_bytes=out,
                        validate=rec.validate if validate else None, quantized=quantized, nproc=nproc,
                        expert_bytes=expert_bytes, rates=rates)


def quantized_fraction(ckpt, decisions) -> float:
    """The fraction of the decoder layers' routed experts (MTP aside) that decode stores as new INT4."""
    from quantkit.conversion.precision import INT4
    from quantkit.model.tensors import TensorClass

    downs = [n for n, st in ckpt.tensors.items()
             if st.info.klass == TensorClass.ROUTED_EXPERT and st.info.proj == "down_proj" and not st.info.mtp]
    return sum(decisions[n].decode == INT4 for n in downs) / max(len(downs), 1)


