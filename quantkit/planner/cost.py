"""What a conversion will cost, computed before it starts: memory, disk, time; and the settings that
keep it inside a memory budget.

`convert` calls `plan_convert` to size its activation store, micro-batches, expert chunks and
output shards, prints the result, and refuses to start when even the smallest settings exceed
the budget; `quantkit plan MODEL --convert` prints the same object for a model that is not on
disk. One function for both, so the prediction is the engine's own accounting.

Memory, in bytes (D hidden, I expert width, N x T calibration tokens, k experts per token,
C experts per chunk, B samples per micro-batch, w = 4 bytes per float32; compute is float32):

    base          the Python process with torch and quantkit imported (measured, BASE_BYTES), and
                  transformers' tokenizer when the calibration tokenizes text (TOKENIZER_BYTES)
    writer        the two output writers' buffers: the part being filled, one layer's tensors up
                  to a shard, each. The part cut before it is saved by a background thread
                  (safetensors 0.8 writes from the tensors' memory, no serialized copy) within
                  shard / disk bandwidth seconds of the cut, long before the next expert chunk's
                  GPTQ reaches its peak (loading and Hessians come first), so it is not in the
                  peak: the real-shape GLM at 8 x 512 under 8 GB peaked in GPTQ's factorization
                  with both buffers partly filled (docs/benchmarks.md, "Real width: memory and the planner")
    dense_layer,  a dense layer's weights, and a MoE layer's weights other than its routed
    moe_layer     experts, float32
    load_transient dequantizing the largest tensor: 3 float32 copies (values, scales, product);
                  the source itself costs nothing beyond that: it is read with positioned reads
                  into memory freed with each tensor, not memory-mapped (quantkit.checkpoint.reader)
    store         h and x for every calibration token: 2 N T D bytes-per-element (MoE layers)
                  (0 in RAM when disk-backed)
    routing       top-k ids (int16) and weights (float32): 6 N T k
    attention     one micro-batch: B T tokens x (hidden-wide and head-wide activations) plus
                  3 B heads T^2 w for scores, masked scores and probabilities
    experts       C x max(7 I D w + D^2 w, 5 I D w + 2 I D + 2 D^2 w): source weights (kept for
                  the held-out guard), the row-stacked gate/up and, during GPTQ, H being factored
                  and its factor; plus each expert's held-out rows (1/8 of its routed tokens), one
                  micro-batch's gathered rows and down inputs, and the all-token H.
                  AWQ reads instead, per expert of the chunk, its routed rows n = N T k / E as
                  inputs, outputs and down inputs (n (2D + 2I) w), from the micro-batches; a
                  method that gathers the layer's MoE inputs whole (Inputs.LAYER) adds N T D w

    peak = base + writer + store + routing + max(attention phase, experts phase)
    attention phase = max over dense/MoE layers of (layer weights + max(load_transient, attention))
    experts phase   = moe_layer + experts

On a GPU, layer/store/routing/attention/experts are device memory, base/writer and the source's
pages host memory (plus the store when it lives in pinned host memory).

Settings, within the room the budget leaves after routing, the ranks' `received` (below) and, on
the CPU, base and writer: B halves from N while one micro-batch's attention or expert rows take
over 15% of it (on the CPU also while they take over MICRO_BATCH_CPU_BYTES); the store is the first of float32 in memory, bfloat16 in memory, bfloat16 on disk
(on a GPU, one over half the room goes to pinned host memory if it takes under 70% of the host
budget less base and writer) that leaves room for min(4, E) experts per chunk, else the first that
leaves one; C is as many experts as that room holds, at most CHUNK_MAX (CHUNK_MAX_GPU on a GPU);
shards are 1/16 of the host budget, from 256 MiB up to max_shard_bytes (5 GiB).

Several ranks (`nproc`, quantkit.runtime.distributed: torchrun, one rank per GPU): every figure is per
rank. The routed experts' Hessians and GPTQ are split by experts (balanced by routed tokens, so
divided by nproc); attention and the routed-expert outputs by micro-batches (the busiest rank's
share of them, `token_share`); the rest is done by every rank. Memory adds `received`, every INT4
expert of a layer quantized (int8 q + bf16 scales), which each rank holds between the exchange and
the h update (every rank still holds the whole store); time adds `exchange`, broadcasting them,
and `gather`, giving every rank the micro-batches' h, x and routing the others computed.

Time is FLOPs over a sustained rate per device (the rates are quantkit.planner.budgets':
CPU_FLOPS_PER_THREAD measured on the 2-core test machine, GPTQ's column loop at CPU_GPTQ_EFFICIENCY
of it; GPU rates from the data sheet at the efficiency stated in GPU_SPECS), bytes over disk bandwidth, and a per-column kernel-launch cost for
GPTQ's column loop on a GPU. The disk works while the layers compute (the next layer is read ahead,
cut parts are saved in the background): the run pays the first layer's read, the last layer's
write, `disk_wait` when reads and writes together need longer than the compute, and
`resume_state`, rank 0 saving h for --resume every `state_every` layers (STATE_OVERHEAD). Validate:
each rank's share of the three checkpoints as stored, what of it fits in memory (kept), the reads
(all once, then per greedy token what was not kept) and the compute. `rates` sets what-ifs
(`--disk-gbps`). It is an estimate; docs/benchmarks.md compares it with measurements.

`plan_convert` takes these steps in order: the memory terms (`_memory_terms`), the settings
(`_choose_settings`), the memory table and peaks (`_memory_table`), the rates (`_device_rates`),
the phases' arithmetic and times (`_phase_flops`, `_phase_seconds`), the multi-rank terms (`_multi_rank_terms`), the disk's
overlap with the compute and the resume state (`_overlap_disk`), and validate
(`_validate_estimate`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from quantkit.errors import ConfigError
from quantkit.model.ops import SCORE_CHUNK_BYTES
from quantkit.planner.budgets import (
    BASE_BYTES,
    CHUNK_MAX,
    CHUNK_MAX_GPU,
    CPU_DISK,
    CPU_FLOPS_PER_THREAD,
    CPU_GPTQ_EFFICIENCY,
    F32,
    GLOO_BYTES,
    GPU_SPECS,
    LAUNCHES_PER_COLUMN,
    LONG_SAMPLES,
    NVLINK_BYTES,
    TOKENIZER_BYTES,
    LayerShapes,
    device_memory,
    expert_flops,
    layer_shapes,
    long_len,
    parse_bytes,
    validate_exchange,
    validate_room,
)
from quantkit.quant.awq import BLOCK as AWQ_BLOCK
from quantkit.quant.methods import Inputs
from quantkit.runtime.machine import available_host_memory, peak_rss  # noqa: F401
from quantkit.runtime.units import GB, GiB

if TYPE_CHECKING:
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.model.arch import ModelArch
    from quantkit.quant.methods import Method
    from quantkit.recipe import Recipe


MIN_SHARD = 256 * 2**20
# convert's resume state holds h for every calibration token (26 GB for GLM 5.2's shipped recipe in
# float32: 13 s at 2 GB/s); it is saved every `state_every` layers, as many as keep its writing
# under this fraction of the run (ConvertCost.state_every)
STATE_OVERHEAD = 0.05
# On the CPU a micro-batch's work (attention activations and scores, or the experts' gathered rows)
# is capped at this many bytes whatever the budget: its FLOPs per token do not depend on the batch
# beyond a few thousand rows, and every byte of it is peak RSS (the random DeepSeek-V3-layout
# benchmark, 64 x 256 tokens at hidden 1024: one 64-sample micro-batch's attention took the peak
# to 975 MB, eight samples at a time 8x less of it; docs/benchmarks.md, "Peak memory"). The tiny
# recipes' 64 x 64 windows (66 MB) stay one micro-batch.
MICRO_BATCH_CPU_BYTES = 128 * 2**20
# On the CPU, AWQ's search rows gathered for one expert chunk (each expert's fit and held-out inputs,
# `_awq_rows`) are capped at this many bytes whatever the budget, for the
# same reason: an expert's search and GPTQ do not depend on which experts share its chunk (the bytes
# are the same), and with the budget at the machine's free memory a 16-expert chunk at 512 x 512
# calibration tokens gathered 6 GB at hidden 512, two experts at a time 3.5 GB and the same bytes; the
# tiny GLM at 512 x 512: 8 experts a chunk under 256 MiB, peak 1.07 GB against 16 experts' 1.21 GB, same bytes.
AWQ_ROWS_CPU_BYTES = 2**28


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
    flops: dict[str, float]  # compute phase -> its arithmetic, FLOPs of one rank before the split by micro-batches
    validate_seconds: float | None
    validate_share: int | None = None  # bytes of the three checkpoints one rank reads (its experts only), as stored
    validate_kept: int | None = None  # of which validate keeps in memory (device, then host); the rest is re-read per pass
    validate_peak: int | None = None  # validate's peak in the memory it computes in (host on the CPU, device on a GPU)
    state_every: int = 1  # convert saves its resume state after every this many layers (STATE_OVERHEAD)
    notes: list[str] = field(default_factory=list)
    fits: bool = True
    reason: str = ""
    nproc: int = 1  # ranks (quantkit.runtime.distributed); memory and time are per rank, all ranks in parallel
    probe: int = 0  # the method's probe windows (Method.probe_windows), counted in tokens

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["store"] = {"dtype": str(self.store.dtype).removeprefix("torch."), "backing": self.store.backing,
                      "location": self.store.location, "micro_batch": self.store.micro_batch}
        d["seconds_total"] = round(sum(self.seconds.values()), 1)
        return d

    def summary(self) -> str:
        s = self.store
        dev = f", peak device {_sz(self.peak_device)} of {_sz(self.gpu_budget)}" if self.peak_device else ""
        where = "disk" if s.backing == "disk" else ("device" if s.location == "device" and self.device != "cpu" else "host")
        ranks = f" per rank ({self.nproc} ranks)" if self.nproc > 1 else ""
        total = sum(self.seconds.values())
        small = total < RESOLUTION_S
        lines = [
            f"predicted{ranks}: peak host {_sz(self.peak_host)} of {_sz(self.host_budget)} budget{dev}; "
            + (f"time under {RESOLUTION_S:g} s: below the planner's resolution (its rates are sustained rates of "
               "large matmuls and transfers; a model this small is dominated by fixed costs it does not model)" if small else
               f"time {_hms(total)} (" + ", ".join(f"{k} {_hms(v)}" for k, v in self.seconds.items()) + ")"),
            f"  activations: {self.tokens} tokens in {str(s.dtype).removeprefix('torch.')} on {where}, "
            f"{s.micro_batch} samples per micro-batch; {self.expert_chunk} experts per chunk; "
            f"shards up to {_sz(min(self.shard_bytes, max(self.disk['prefill'], self.disk['decode'])))}; disk {_sz(sum(self.disk.values()))} "
            f"(prefill {_sz(self.disk['prefill'])}, decode {_sz(self.disk['decode'])}, "
            f"resume state {_sz(self.disk['resume_state'])} at its peak)",
        ]
        if self.validate_seconds is not None:
            lines.append(f"  validate: {_about(self.validate_seconds)}; the checkpoints' share{' per rank' if ranks else ''} "
                         f"{_sz(self.validate_share)} as stored, {_sz(self.validate_kept)} of it kept in memory; "
                         f"peak {'device' if self.device != 'cpu' else 'host'} {_sz(self.validate_peak)}")
        lines += [f"  note: {n}" for n in self.notes]
        if not self.fits:
            lines.append(f"  does not fit: {self.reason}")
        return "\n".join(lines)


RESOLUTION_S = 10.0  # below this the time prediction means nothing (fixed costs dominate: imports, file opens)


def _sz(n: float) -> str:
    """Sizes in the unit that reads: GB from 0.1 GB, MB below, bytes below 1 MB (a tiny model's 5.6 MB
    was "0.01 GB")."""
    from quantkit.runtime.units import decimal_bytes

    return decimal_bytes(n, digits=2, gb_from=1e8, bytes_below=1e6)


def _about(s: float) -> str:
    return f"under {RESOLUTION_S:g} s" if s < RESOLUTION_S else f"about {_hms(s)}"


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


def reused_per_expert(x: LayerShapes) -> int:
    """One expert of a chunk when decode reuses the source's INT4 (nothing quantized, Kimi K2.6): its
    weights dequantized to float32 for the h update (gate, up, down: 3 I D w), no Hessian, no GPTQ.
    Once per chunk as much again (`_Memory.chunk_extra`): prefill's FP8 quantization of one of its
    tensors (the real-shape Kimi at 8 x 512 under 8 GB peaked there, writing a 16-expert chunk)."""
    return 3 * x.expert_width * x.hidden * F32


def _awq_per_expert(x: LayerShapes, tokens: int) -> int:
    """One expert of an AWQ chunk: GPTQ's work on the smoothed weights (`_per_expert`), plus the
    search's per-expert rows (`_awq_rows`), the s = 1 alternative's dequantized weights kept for the guard,
    and what quantkit.quant.awq holds beside GPTQ: gate, up and down stacked as float32 (3 I D) and the
    smoothing folded into up and down (2 I D). Measured at hidden 1024 (random-dsv3-wide, random-glm-wide
    at 32 x 64): without the last two terms the peak was 1.20-1.26x the prediction."""
    return _per_expert(x, tokens) + _awq_rows(x, tokens) + (3 + 3 + 2) * x.expert_width * x.hidden * F32


def _awq_rows(x: LayerShapes, tokens: int) -> int:
    """The search's rows of one expert (quantkit.quant.methods.awq.expert_rows): its fit and held-out
    inputs, each allocated at its final size and filled in place (n x D, n its routed tokens on average)."""
    n = tokens * x.topk // max(x.experts, 1)
    return n * F32 * x.hidden


def _awq_block(x: LayerShapes, tokens: int) -> int:
    """The search's work space, once per chunk (quantkit.quant.awq.awq_experts runs its experts' statistics
    one after another): one block of AWQ_BLOCK rows of gate's and up's outputs, z, and the output
    error's two rows x D terms; every statistic is accumulated a block at a time, so no n x I array is held."""
    n = tokens * x.topk // max(x.experts, 1)
    return min(n, AWQ_BLOCK) * F32 * (3 * x.expert_width + 2 * x.hidden)


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


@dataclass
class _Memory:
    """A run's memory terms (the module docstring's components, bytes) and the room left for its
    work: device memory on a GPU, host memory on the CPU."""

    x: LayerShapes
    calibrate: bool
    awq: bool  # the method's search holds each expert's rows (Inputs.LAYER or EXPERT_ROWS: AWQ)
    gathers: bool  # ... and the layer's MoE inputs whole (Inputs.LAYER)
    T: int  # tokens per sample (0 without calibration)
    tokens: int  # N x T
    on_gpu: bool
    host: int  # the host budget
    budget: int  # the budget the compute works in (the GPU's on a GPU, else the host's)
    chunk_max: int
    w_dense: int
    w_moe: int
    transient: int
    per_expert: int  # one routed expert of a chunk at its peak (AWQ's when awq)
    shard: int
    writer: int
    routing: int
    base: int  # the process before the first tensor (BASE_BYTES, + TOKENIZER_BYTES when the calibration tokenizes)
    host_fixed: int  # base + writer
    dev_fixed: int  # what the compute's memory holds before any layer: routing (+ base + writer on the CPU)
    received: float  # multi-rank: a layer's quantized experts every rank holds (0 with one rank)
    shared_work: bool  # the ranks split the experts' Hessians and GPTQ (and exchange the result)
    E4: int  # a layer's experts that are quantized: what ranks split and exchange
    room: float  # budget - dev_fixed - received: for the store and a layer's work
    chunk_extra: int = 0  # once per chunk on top of its experts (reused experts: one tensor's FP8 quantization)

    def attention_phase(self, B: int) -> int:
        """Loading a layer and running its attention half (and dense MLP / shared expert)."""
        att = _attention_bytes(self.x, B, self.T) if self.calibrate else 0
        return max(self.w_dense + max(self.transient, att), self.w_moe + max(self.transient, att))

    def experts_phase(self, B: int, C: int) -> int:
        """A MoE layer's routed experts, C at a time."""
        x = self.x
        if not self.calibrate:
            return self.w_moe + C * 3 * x.expert_width * x.hidden * F32 * 2
        gathered = self.tokens * x.hidden * F32 if self.gathers else 0  # Inputs.LAYER: the layer's x read whole
        return self.w_moe + C * self.per_expert + self.chunk_extra + _expert_mb_bytes(x, B, self.T) + gathered


def _memory_terms(x: LayerShapes, *, method: Method, group_size: int, calibrate: bool, N: int, T: int, on_gpu: bool,
                  host: int, gpu_mem: int | None, output_bytes: tuple[int, int], max_shard_bytes: int, quantized: float,
                  nproc: int, tokenizes: bool = True) -> _Memory:
    tokens = N * T
    budget = gpu_mem if on_gpu else host  # where the compute work lives
    shard = min(max_shard_bytes, max(MIN_SHARD, host // 16))
    n_layers = max(x.layers, 1)
    # the part being filled per output (an expert-heavy layer's share, up to a shard); not the one being saved
    writer = sum(min(int(b / n_layers * 1.5), shard) for b in output_bytes)
    routing = tokens * x.topk * 6
    base = BASE_BYTES + (TOKENIZER_BYTES if tokenizes and calibrate else 0)
    host_fixed = base + writer
    dev_fixed = (0 if on_gpu else host_fixed) + routing
    # multi-rank: a layer's INT4 experts, quantized (int8 q, bf16 scale per group), held by every rank
    # from the exchange to the end of the h update; taken from the room before the chunk is sized
    # (an expert's GPTQ bytes do not depend on its chunk, so the output stays the single-process one)
    E4 = round(quantized * x.experts)
    shared_work = nproc > 1 and calibrate and method.calibrated and E4 > 0
    received = E4 * 3 * x.expert_width * x.hidden * (1 + 2 / group_size) if shared_work else 0
    quantizes = calibrate and method.calibrated and E4 > 0
    awq = quantizes and method.inputs in (Inputs.LAYER, Inputs.EXPERT_ROWS)  # the method holds expert rows (AWQ's search)
    if quantizes:
        per_expert = _awq_per_expert(x, tokens) if awq else _per_expert(x, tokens)
    else:  # nothing to quantize (every routed expert the source's INT4, reused): a chunk holds its weights
        per_expert = reused_per_expert(x)
    # reused INT4 experts are stored FP8 in prefill: quantizing one tensor (float32 copies of it) beside the chunk
    chunk_extra = reused_per_expert(x) if calibrate and not quantizes else 0
    if awq:
        chunk_extra += _awq_block(x, tokens)
    gathers = awq and method.inputs is Inputs.LAYER  # and the layer's inputs whole
    return _Memory(
        x=x, calibrate=calibrate, awq=awq, gathers=gathers, T=T, tokens=tokens, on_gpu=on_gpu, host=host, budget=budget,
        chunk_max=CHUNK_MAX_GPU if on_gpu else CHUNK_MAX, w_dense=x.dense_layer_params * F32,
        w_moe=x.moe_layer_params * F32,
        transient=3 * x.largest_tensor * F32,  # dequantizing one FP8 tensor: values, expanded scales, product
        per_expert=per_expert, shard=shard, writer=writer,
        routing=routing, base=base, host_fixed=host_fixed, dev_fixed=dev_fixed, received=received, shared_work=shared_work,
        E4=E4, room=budget - dev_fixed - received, chunk_extra=chunk_extra)


# The activation store's dtypes (quantkit.conversion.activations keeps h and x in one of them).
STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class StorePlan:
    """Where and how the calibration activations live (quantkit.conversion.activations.ActivationStore
    is built with it; `plan_convert` decides it from the budget)."""

    dtype: torch.dtype = torch.float32
    backing: str = "memory"  # memory | disk
    location: str = "device"  # memory backing: on the compute device, or in host memory
    micro_batch: int = 8  # samples per read/write


# ---- the settings: micro-batch, activation store, experts per chunk


def _store_options(activation_dtype: str | None) -> list[tuple[torch.dtype, str]]:
    """The stores to try, in order: float32 in memory, bfloat16 in memory, bfloat16 on disk; or
    the forced dtype in memory, then on disk."""
    if activation_dtype is None:
        return [(torch.float32, "memory"), (torch.bfloat16, "memory"), (torch.bfloat16, "disk")]
    if activation_dtype not in STORE_DTYPES:
        raise ConfigError(f"activation dtype {activation_dtype!r}: use float32 or bfloat16")
    forced = STORE_DTYPES[activation_dtype]
    return [(forced, "memory"), (forced, "disk")]


def _micro_batch(m: _Memory, N: int) -> int:
    """Samples per micro-batch: N, halved while one micro-batch's attention or expert rows take more
    than 15% of the room (on the CPU, more than MICRO_BATCH_CPU_BYTES)."""
    def over(B: int) -> bool:
        att, rows = _attention_bytes(m.x, B, m.T), _expert_mb_bytes(m.x, B, m.T)
        if max(att, rows) > 0.15 * m.room:
            return True  # the cap counts what grows with B (not the all-token H)
        return not m.on_gpu and max(att, rows - _expert_mb_bytes(m.x, 0, m.T)) > MICRO_BATCH_CPU_BYTES

    B = max(N, 1)
    while B > 1 and over(B):
        B = (B + 1) // 2
    return B


def _store_choice(m: _Memory, B: int, options: list[tuple[torch.dtype, str]]) -> tuple | None:
    """(dtype, backing, location, experts per chunk, store bytes in memory) of the first option
    that leaves room for min(4, E) experts per chunk, else of the first that leaves room for one;
    None when none does. On a GPU a store over half the room goes to pinned host memory, if it
    takes under 70% of what the host has left."""
    fallback = None
    for dt, backing in options:
        store_b = 2 * m.tokens * m.x.hidden * (4 if dt == torch.float32 else 2) if backing == "memory" else 0
        if m.on_gpu and backing == "memory" and store_b > 0.5 * m.room:  # on a GPU: try pinned host memory
            location = "host" if store_b < 0.7 * (m.host - m.host_fixed) else None
        else:
            location = "device"
        if location is None:
            continue
        left = m.room - (store_b if location == "device" else 0)
        if m.attention_phase(B) > left:
            continue
        C = int((left - m.experts_phase(B, 0)) // m.per_expert)
        C = max(min(C, m.chunk_max, m.x.experts), 0)
        cand = (dt, backing, location, C, store_b)
        if C >= min(4, m.x.experts):
            return cand
        if C >= 1 and fallback is None:
            fallback = cand
    return fallback


def _choose_settings(m: _Memory, N: int, activation_dtype: str | None) -> tuple[int, tuple | None]:
    """(samples per micro-batch, the store choice as `_store_choice` gives it). Without calibration
    there is no store: the chunk is what the room leaves at the experts' float32 weights."""
    if not m.calibrate:
        C = int((m.room - m.experts_phase(1, 0)) // (3 * m.x.expert_width * m.x.hidden * F32 * 2))
        return max(N, 1), (torch.float32, "memory", "device", max(min(C, m.chunk_max, m.x.experts), 0), 0)
    B = _micro_batch(m, N)
    choice = _store_choice(m, B, _store_options(activation_dtype))
    if choice is not None and m.awq and not m.on_gpu:  # AWQ_ROWS_CPU_BYTES
        dt, backing, location, C, store_b = choice
        choice = (dt, backing, location, min(C, max(1, AWQ_ROWS_CPU_BYTES // _awq_rows(m.x, m.tokens))), store_b)
    return B, choice


def _knob(m: _Memory) -> str:
    return "--max-gpu-memory" if m.on_gpu else "--max-host-memory"


def _no_room_reason(m: _Memory) -> str:
    need = m.dev_fixed + max(m.attention_phase(1), m.experts_phase(1, 1))
    knob = _knob(m)
    return (f"{knob} {m.budget / GB:.1f} GB cannot hold one layer's work even with the activations on disk "
            f"and one expert at a time (needs about {need / GB:.1f} GB): raise {knob}"
            + (", or lower --seq-len (attention scores grow with its square)" if m.calibrate else ""))


def _memory_table(m: _Memory, B: int, C: int, location: str, store_b: int) -> tuple[dict[str, int], float, float | None]:
    """(the components, peak host, peak device: None on the CPU), as the module docstring sums them."""
    work = max(m.attention_phase(B), m.experts_phase(B, C))
    memory = {"base": m.base, "writer": m.writer, "store": store_b, "routing": m.routing,
              "dense_layer": m.w_dense, "moe_layer": m.w_moe, "load_transient": m.transient,
              "attention": _attention_bytes(m.x, B, m.T) if m.calibrate else 0,
              "experts": m.experts_phase(B, C) - m.w_moe, "work": work, "received": int(m.received)}
    if m.on_gpu:
        peak_device: float | None = (store_b if location == "device" else 0) + m.routing + work + m.received
        peak_host: float = m.host_fixed + (store_b if location == "host" else 0) + m.transient
    else:
        peak_device = None
        peak_host = m.host_fixed + store_b + m.routing + work + m.received
    return memory, peak_host, peak_device


def _store_notes(m: _Memory, store: StorePlan, activation_dtype: str | None) -> list[str]:
    notes = []
    if m.calibrate and store.dtype == torch.bfloat16 and activation_dtype is None:
        notes.append("hidden states stored in bfloat16 (float32 does not fit the budget)")
    if m.calibrate and m.x.has_dsa and m.T > m.x.index_topk:
        notes.append(f"seq_len {m.T} > index_topk {m.x.index_topk}: DSA selections are kept per micro-batch")
    return notes


# ---- time


@dataclass(frozen=True)
class _Rates:
    flops: float  # matmul FLOP/s
    disk: float  # bytes/s, reads and writes together
    launch: float  # seconds per kernel launch (0 on the CPU)
    gptq: float  # GPTQ's column loop, FLOP/s
    link: float  # bytes/s between ranks


def _device_rates(on_gpu: bool, gpu: str | None, rates: dict[str, float]) -> _Rates:
    if on_gpu:
        spec = GPU_SPECS.get(gpu or "h200", GPU_SPECS["h200"])
        flops, disk_bw, launch = spec["flops"], spec["disk"], spec["launch"]
    else:
        flops, disk_bw, launch = CPU_FLOPS_PER_THREAD * torch.get_num_threads(), CPU_DISK, 0.0
    flops, disk_bw = rates.get("flops", flops), rates.get("disk", disk_bw)
    if flops <= 0 or disk_bw <= 0:
        raise ConfigError(f"--disk-gbps {disk_bw / 1e9:g}, matmul {flops / 1e12:g} TFLOP/s: both must be positive")
    return _Rates(flops=flops, disk=disk_bw, launch=launch, gptq=flops * (1.0 if on_gpu else CPU_GPTQ_EFFICIENCY),
                  link=NVLINK_BYTES if on_gpu else GLOO_BYTES)


def _phase_flops(m: _Memory, *, method: Method, quantized: float, nproc: int, probe_work: float = 1.0) -> dict[str, float]:
    """The arithmetic of each compute phase of one rank's run, FLOPs, before the split by micro-batches
    (ConvertCost.flops). probe_work: the quantizing arithmetic's multiple with the method's probe
    (ProbeCost.work: GPTQ at two dampenings in one batched call)."""
    x, tokens, T = m.x, m.tokens, m.T
    D, I = x.hidden, x.expert_width
    L, Lm = x.calibrated_layers, x.calibrated_moe_layers  # the calibration pass: every main layer and the first MTP
    attn = tokens * (2 * x.attn_params + 2 * 2 * x.heads * T * (x.qk_head + x.v_head)) * L
    attn += tokens * 2 * 3 * D * (x.dense_width * (L - Lm) + x.shared_width * Lm)  # dense MLP / shared expert
    routed = tokens * x.topk  # token-expert pairs per MoE layer
    gptq_on = m.calibrate and method.calibrated
    # the experts that get Hessians and GPTQ (not the reused source INT4 ones), this rank's part of them
    share = quantized / (nproc if m.shared_work else 1)
    per_token_hess, per_expert_gptq = expert_flops(D, I)
    data_free = method.data_free().flops_per_weight  # its data-free form's experts (MTP, or all)
    return {
        "attention": attn,
        "hessians": share * routed * per_token_hess * Lm if gptq_on else 0,
        "gptq": share * x.experts * Lm * per_expert_gptq * probe_work if gptq_on else 0,
        "rtn": x.experts * (x.moe_layers - (Lm if gptq_on else 0)) * 3 * I * D * data_free,
        "experts_out": routed * 2 * 3 * I * D * Lm if m.calibrate else 0,
    }


def _phase_seconds(m: _Memory, r: _Rates, flops: dict[str, float], *, method: Method, C: int, source_bytes: int,
                   output_bytes: tuple[int, int], quantized: float, nproc: int) -> dict[str, float]:
    """Seconds per phase of one rank's run from `flops` (`_phase_flops`), before the split by
    micro-batches and the disk overlap; GPTQ's column loop adds its kernel launches per chunk."""
    x = m.x
    share = quantized / (nproc if m.shared_work else 1)
    gptq_on = m.calibrate and method.calibrated
    chunks = x.calibrated_moe_layers * math.ceil(share * x.experts / C)
    gptq_launch = chunks * (x.hidden + x.expert_width) * LAUNCHES_PER_COLUMN * r.launch if gptq_on else 0.0
    return {
        "read": source_bytes / r.disk,
        "attention": flops["attention"] / r.flops,
        "hessians": flops["hessians"] / r.flops,
        "gptq": flops["gptq"] / r.gptq + gptq_launch + flops["rtn"] / r.flops,
        "experts_out": flops["experts_out"] / r.flops,
        "write": (output_bytes[0] + output_bytes[1]) / r.disk,
    }


def _multi_rank_terms(seconds: dict[str, float], m: _Memory, r: _Rates, *, N: int, store: StorePlan, nproc: int) -> list[str]:
    """Several ranks (the module docstring): the token split scales attention and experts_out to the
    busiest rank's micro-batches and adds `gather`; the expert split adds `exchange`. Updates
    `seconds`; returns the notes saying what is split."""
    if nproc > 1 and m.calibrate:  # the token split: each rank runs the per-token work of its own micro-batches
        share_tokens = token_share(N, store.micro_batch, nproc)
        seconds["attention"] *= share_tokens
        seconds["experts_out"] *= share_tokens
        seconds["gather"] = gather_bytes(m.x, N, m.T, store.dtype, nproc) / r.link
    if m.shared_work:  # each rank receives the others' share of every layer's quantized experts
        seconds["exchange"] = m.received * (nproc - 1) / nproc * m.x.calibrated_moe_layers / r.link
        return [f"{nproc} ranks: attention and experts_out are split by micro-batches (then h, x and the "
                "routing are gathered), hessians and gptq by experts (balanced by routed tokens); read is "
                "done by every rank; write is spread over the ranks, at one disk's bandwidth "
                "(docs/distributed.md)"]
    if nproc > 1 and m.calibrate:
        return [f"{nproc} ranks: no expert is quantized here (reused source INT4), so only attention and "
                "experts_out are split (by micro-batches); read and the rest are done by every rank "
                "(docs/distributed.md)"]
    if nproc > 1:
        return [f"{nproc} ranks: no calibration, so there is nothing to split: every rank repeats the whole "
                "run; use one (docs/distributed.md)"]
    return []


def _overlap_disk(seconds: dict[str, float], layers: int, state_bytes: int, disk_bw: float) -> int:
    """The disk works while the layers compute: the next layer is read ahead (conversion.Prefetcher)
    and the cut parts are saved in the background (CheckpointWriter). Reading the first layer and
    saving the last one's parts add to the run, and so does the time the disk (reads and writes
    share it) needs beyond the compute's (`disk_wait`); rank 0 saving h for --resume adds
    `resume_state`. Updates `seconds`; returns the layers between two state saves."""
    compute = sum(v for k, v in seconds.items() if k not in ("read", "write"))
    io = seconds["read"] + seconds["write"]
    seconds["read"] /= max(layers, 1)
    seconds["write"] /= max(layers, 1)
    if io > compute:
        seconds["disk_wait"] = io - compute
    every = 1
    if state_bytes:  # rank 0 saves h for --resume every `every` layers (conversion.convert)
        save_s = state_bytes / disk_bw
        compute = sum(v for k, v in seconds.items() if k not in ("read", "write", "disk_wait"))
        every = state_every(save_s, compute / max(layers, 1))
        seconds["resume_state"] = (1 + math.ceil(layers / every)) * save_s
    return every


def _validate_estimate(arch, m: _Memory, r: _Rates, validate, *, device: str, gpu_mem: int | None, nproc: int,
                       source_bytes: int, output_bytes: tuple[int, int],
                       expert_bytes: int | None) -> tuple[float, int, int, int, list[str]]:
    """(seconds, the rank's share of the three checkpoints as stored, what of it it keeps, the peak of the
    memory it computes in (the host's on the CPU, the GPU's on one), notes).

    quantkit.validation.pipeline: every rank runs attention for all eval tokens and its share of the
    routed experts (their output rows exchanged); it keeps its share of the three checkpoints
    resident, as stored, when that fits beside the layer loop, else every pass re-reads the layers."""
    x = m.x
    vt = validate.num_samples * validate.seq_len
    passes = max(validate.gen_tokens, 1)  # the prompt pass yields the first token; each further one is a pass
    three = source_bytes + output_bytes[0] + output_bytes[1]
    experts_b = three * 0.95 if expert_bytes is None else expert_bytes
    share = int(three - experts_b + experts_b / nproc)
    streams = 3  # the prompt pass: reference, prefill, decode
    exchange = validate_exchange(arch, vt, nproc)
    n_long = long_len(arch, None, "config.json")  # validate's default long-context window (0: no indexer)
    budget = gpu_mem if m.on_gpu else m.host
    room = validate_room(arch, device, budget, exchange, n_long)
    # the memory validate computes in peaks at its working set (the loop, the exchange, the long window) plus
    # what it keeps there
    peak = int(budget - room + min(share, max(room, 0)))
    if m.on_gpu:  # then the rank's host memory
        room = max(room, 0) + validate_room(arch, "cpu", m.host)
    kept = int(min(share, max(room, 0)))
    # the first pass reads the three checkpoints; each further one what the ranks could not keep
    # (the routed experts: the shared tensors are kept first), from one disk
    again = min(three, nproc * (share - kept))
    vflops = vt * 2 * (x.attn_params + 3 * x.topk * x.expert_width * x.hidden / nproc) * x.layers * streams
    seconds = (three + (passes - 1) * again) / r.disk + vflops / r.flops
    seconds += x.calibrated_moe_layers * exchange * (nproc - 1) / nproc / r.link
    notes: list[str] = []
    long_s = _long_context_seconds(arch, x, validate, again, r, notes)
    seconds += long_s
    if validate.gen_tokens and again:
        notes.append(f"validate: {kept / GB:.0f} of a rank's {share / GB:.0f} GB share kept in memory, so each "
                     f"greedy token re-reads {again / GB:.0f} GB from disk ({validate.gen_tokens} tokens); more "
                     f"ranks or a larger budget keep it all (docs/distributed.md)")
    return seconds, share, kept, peak, notes


def _long_context_seconds(arch, x, validate, again: int, r: _Rates, notes: list[str]) -> float:
    """validate's long-context pass for a DSA model (quantkit.validation.longctx): one more prompt pass of
    the three checkpoints over a few windows past index_topk, re-reading what the ranks do not keep;
    0 for a model without an indexer."""
    n = long_len(arch, None, "config.json")
    if not n:
        return 0.0
    windows = min(validate.num_samples, LONG_SAMPLES)
    tokens = windows * n
    flops = tokens * 2 * (x.attn_params + 3 * x.topk * x.expert_width * x.hidden) * x.layers * 3
    # the reference's scores are dense, (windows, heads, n, n) float32 per layer for attention and the
    # indexer, but held in query chunks of at most SCORE_CHUNK_BYTES (quantkit.model.ops.attention)
    scores = windows * (arch.num_attention_heads + arch.index_n_heads) * n * n * 4
    seconds = again / r.disk + flops / r.flops
    notes.append(f"validate: long-context rows (DSA): {windows} windows of {n} tokens past index_topk {arch.index_topk}, "
                 f"one more pass, {_about(seconds)}; its attention and indexer scores ({_sz(scores)} per layer) are "
                 f"computed in query chunks of at most {_sz(SCORE_CHUNK_BYTES)} (`validate --long-context N` sets the length)")
    return seconds


# ---- the estimate


def plan_convert(
    arch,
    *,
    method: Method,
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
    probe: int = 0,
    tokenizes: bool = True,
) -> ConvertCost:
    """Settings and predicted cost of converting `arch` (see the module docstring for the terms).

    tokenizes: whether the calibration reads text through a tokenizer (quantkit.inputs.tokens.reads_text),
    which adds TOKENIZER_BYTES to the base; ids (synthetic, random, token files) do not.

    method: the registered method (quantkit.quant.methods: its inputs, cost terms and probe cost).
    probe: the method's probe windows (Method.probe_windows; GPTQ's for gptq.low_dampening): stored and
    run through every layer like calibration windows, never fitted on; what else they cost is the
    method's (Method.probe_cost: GPTQ quantizes every expert a second time).

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
    on_gpu = device == "cuda"
    N, T = (num_samples + probe, seq_len) if calibrate else (0, 0)
    m = _memory_terms(x, method=method, group_size=group_size, calibrate=calibrate, N=N, T=T, on_gpu=on_gpu, host=host,
                      gpu_mem=gpu_mem, output_bytes=output_bytes, max_shard_bytes=max_shard_bytes, quantized=quantized,
                      nproc=nproc, tokenizes=tokenizes)
    probed = method.probe_cost(probe, x.hidden, x.expert_width) if calibrate and probe else None
    if probed is not None:  # what the method's probe adds per expert of a chunk (GPTQ: W and H stacked twice)
        m.per_expert += probed.expert_bytes
        if not on_gpu:  # on the CPU batching buys no launches (GPTQ: half the chunk, its usual work space)
            m.chunk_max = max(1, int(m.chunk_max * probed.cpu_chunk))

    B, choice = _choose_settings(m, N, activation_dtype)
    fits, reason = True, ""
    if choice is None or choice[3] < 1:
        fits, reason = False, _no_room_reason(m)
        choice = choice or (torch.bfloat16, "disk", "device", 1, 0)
    dt, backing, location, C, store_b = choice
    C = max(C, 1)
    store = StorePlan(dtype=dt, backing=backing, location=location, micro_batch=min(B, max(N, 1)))
    memory, peak_host, peak_device = _memory_table(m, B, C, location, store_b)
    if fits and m.received and (peak_device if on_gpu else peak_host) > m.budget:
        fits = False
        reason = (f"{nproc} ranks: each holds a layer's {m.E4} quantized experts ({m.received / GB:.1f} GB) on top of "
                  f"the single-process work; raise {_knob(m)} or use fewer ranks")
    notes = _store_notes(m, store, activation_dtype)
    state_bytes = m.tokens * x.hidden * (4 if dt == torch.float32 else 2)
    disk = {"prefill": output_bytes[0], "decode": output_bytes[1],
            # at a save the next layer's h is written beside the saved one, removed only once state.json
            # names the new file (quantkit.conversion.resume.save_state): two copies at the peak
            "resume_state": 2 * state_bytes + (2 * state_bytes if backing == "disk" else 0),
            "streamed_source": 0}

    r = _device_rates(on_gpu, gpu, rates)
    flops = _phase_flops(m, method=method, quantized=quantized, nproc=nproc,
                         probe_work=probed.work if probed is not None else 1.0)
    seconds = _phase_seconds(m, r, flops, method=method, C=C, source_bytes=source_bytes, output_bytes=output_bytes,
                             quantized=quantized, nproc=nproc)
    if probe and calibrate:  # the probe's tokens run attention and the expert outputs, but are never fitted on
        seconds["hessians"] *= num_samples / (num_samples + probe)
        flops["hessians"] *= num_samples / (num_samples + probe)
    if method.calibrated and calibrate:
        seconds["gptq"] *= method.time_factor  # e.g. AWQ's scale search on top of GPTQ
        if method.cost_note:
            notes.append(method.cost_note)
        if probed is not None:
            notes.append(probed.note)
    if calibrate and arch.num_mtp_layers:
        notes.append(f"mtp: the first MTP layer is calibrated on the last main layer's h and the next tokens' embeddings; "
                     f"for that layer the embedding table ({_sz(arch.vocab_size * arch.hidden_size * 2)} BF16) "
                     "is read into host memory, and the store becomes the MTP's (T - 1 positions, never a third array)")
    notes += _multi_rank_terms(seconds, m, r, N=N, store=store, nproc=nproc)
    every = _overlap_disk(seconds, x.layers, state_bytes, r.disk)

    validate_s = validate_share = validate_kept = validate_peak = None
    if validate is not None:
        validate_s, validate_share, validate_kept, validate_peak, validate_notes = _validate_estimate(
            arch, m, r, validate, device=device, gpu_mem=gpu_mem, nproc=nproc, source_bytes=source_bytes,
            output_bytes=output_bytes, expert_bytes=expert_bytes)
        notes += validate_notes
    return ConvertCost(device=device, gpu=gpu if on_gpu else None, host_budget=host, gpu_budget=gpu_mem, tokens=m.tokens,
                       store=store, expert_chunk=C, shard_bytes=m.shard, memory=memory, peak_host=int(peak_host),
                       peak_device=int(peak_device) if peak_device is not None else None, disk=disk,
                       seconds={k: round(v, 1) for k, v in seconds.items()}, flops={k: float(f"{v:.4g}") for k, v in flops.items()},
                       validate_seconds=validate_s,
                       validate_share=validate_share, validate_kept=validate_kept, validate_peak=validate_peak, state_every=every,
                       notes=notes, fits=fits, reason=reason, nproc=nproc, probe=probe if calibrate else 0)


def _preset_sizes(model: str, arch: ModelArch, rec: Recipe) -> tuple[int, tuple[int, int], int, float]:
    """(source bytes, (prefill, decode) bytes, routed experts' bytes in the three, quantized
    fraction) of a preset, from the planner's checkpoint sizes at the recipe's group size."""
    from quantkit.model.tensors import TensorClass
    from quantkit.planner.capacity import plan as size_plan
    from quantkit.planner.precision import source_int4_group

    G = rec.group_size
    sg = source_int4_group(arch)
    sizes = size_plan(model, group_size=G).checkpoints
    expert_bytes = sum(sizes[k].bytes_by_class.get(TensorClass.ROUTED_EXPERT.value, 0)
                       for k in ("source", "prefill", "decode"))
    # the preset's experts are in the source's own format: reused when it is the target INT4 scheme
    quantized = 0.0 if (sg == G and rec.decode.reuse_source_int4) else 1.0
    return sizes["source"].total_bytes, (sizes["prefill"].total_bytes, sizes["decode"].total_bytes), expert_bytes, quantized


def _checkpoint_sizes(ckpt: Checkpoint, rec: Recipe) -> tuple[int, tuple[int, int], int, float]:
    """The same as `_preset_sizes` for a checkpoint, from convert's own per-tensor decisions."""
    from quantkit.model.tensors import TensorClass
    from quantkit.planner.precision import decide_all, predicted_bytes

    G = rec.group_size
    decisions = decide_all(ckpt, rec)
    source_bytes = sum(ckpt.storage_bytes(n) for n in ckpt.tensors)
    out = predicted_bytes(ckpt, decisions, G)
    routed = {n: d for n, d in decisions.items() if ckpt.tensors[n].info.klass == TensorClass.ROUTED_EXPERT}
    expert_bytes = sum(ckpt.storage_bytes(n) for n in routed) + sum(predicted_bytes(ckpt, routed, G))
    return source_bytes, out, expert_bytes, quantized_fraction(ckpt, decisions)


def plan_convert_for(
    model: str,
    *,
    recipe: str | None = None,
    gpu: str = "h200",
    method: str | None = None,
    num_samples: int | None = None,
    seq_len: int | None = None,
    calib: str | None = None,
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
    from quantkit.planner.precision import needs_calibration
    from quantkit.planner.target import resolve_target
    from quantkit.recipe import resolve_recipe

    if gpu != "cpu" and gpu not in GPU_SPECS:
        raise ConfigError(f"--gpu {gpu!r}: choose one of {', '.join([*GPU_SPECS, 'cpu'])}")
    target = resolve_target(model)
    arch, ckpt = target.arch, target.checkpoint
    rec = resolve_recipe(model, arch, recipe, method=method, group_size=group_size, num_samples=num_samples,
                         seq_len=seq_len, calib=calib)
    source_bytes, out, expert_bytes, quantized = _preset_sizes(model, arch, rec) if ckpt is None else _checkpoint_sizes(ckpt, rec)
    calibrate = needs_calibration(rec)  # as convert: the KV scales need the pass even when experts are reused
    quantizer = rec.resolved_method
    return plan_convert(arch, method=quantizer, group_size=rec.group_size, num_samples=rec.calibration.windows(),
                        seq_len=rec.calibration.seq_len, calibrate=calibrate, device="cpu" if gpu == "cpu" else "cuda",
                        gpu=None if gpu == "cpu" else gpu, max_host_memory=max_host_memory,
                        max_gpu_memory=max_gpu_memory, source_bytes=source_bytes, output_bytes=out,
                        validate=rec.validate if validate else None, quantized=quantized, nproc=nproc,
                        probe=quantizer.probe_windows(rec) if calibrate and quantized else 0,
                        expert_bytes=expert_bytes, rates=rates, tokenizes=calibration_tokenizes(rec))


def calibration_tokenizes(rec: Recipe) -> bool:
    """Whether any of the recipe's calibration sources is text, read through the model's tokenizer."""
    from quantkit.inputs.tokens import reads_text

    return any(reads_text(spec) for spec, windows in rec.calibration.sources() if windows)


def quantized_fraction(ckpt, decisions) -> float:
    """The fraction of the decoder layers' routed experts (MTP aside) that decode stores as new INT4."""
    from quantkit.model.tensors import TensorClass
    from quantkit.planner.precision import INT4

    downs = [n for n, st in ckpt.tensors.items()
             if st.info.klass == TensorClass.ROUTED_EXPERT and st.info.proj == "down_proj" and not st.info.mtp]
    return sum(decisions[n].decode == INT4 for n in downs) / max(len(downs), 1)


