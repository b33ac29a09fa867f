"""Expert-parallel convert: the ranks torchrun starts, who quantizes which routed expert, and the
exchange that gives every rank every expert's result.

Where a convert's time goes: in a calibrated MoE layer, each routed expert's Hessians (one pass
over the tokens routed to it) and its GPTQ depend on no other expert, so they are split by experts;
the attention half and the routed-expert outputs are per-token work, one micro-batch of samples at
a time, so they are split by micro-batches (micro-batch i: rank i % world, for the whole run); the
rest is done by every rank (design A plus the token split, docs/distributed.md):

    every rank       load the layer, FP8 the shared tensors
    rank i % world   attention + shared expert + routing of micro-batch i
    gather           x, routing and DSA selections of every micro-batch from its owner, KV-cache
                     maxima combined: every rank holds the whole store again (`share_rows`, ...)
    rank r           Hessians, GPTQ and the held-out guard for the experts `partition` gives r
    exchange         each expert's quantized tensors (q, scale) broadcast from its owner, records
                     all-gathered: every rank then holds every expert's result
    rank i % world   h += routed outputs under the decode weights, all experts in ascending order,
                     for micro-batch i; then every micro-batch's h gathered
    every rank       computes every stored tensor, so all cut the same shards; saves the ones it owns
                     (part i of prefill: rank i % world; of decode: rank (i + 1) % world)
    rank 0           the resume state after each layer (after a barrier) and the finish journal

Why the result is byte-identical to a single-process run: every rank runs the single-process code
on the same inputs in the same order (a micro-batch's per-token work on one rank, its results
moved as bytes; the KV-cache maximum is a max, exact in any order), except that an expert's GPTQ batch holds other experts
(its rank's chunk instead of the single-process chunk). GPTQ's batched ops (Cholesky, bmm,
per-row reductions) treat batch members independently, so an expert's bytes do not depend on
its chunk; tests/runtime/test_distributed.py checks this (chunks of 16, 3 and 1 give one output) and
that 2 ranks equal 1.

Validate on N ranks (quantkit.validation.pipeline) uses the same group and `partition`: every rank runs the
attention half for every token, each its own routed experts, whose output rows it broadcasts
(`share_expert_rows`); every rank then adds all experts' rows in ascending order, as one process.

A single process (no torchrun, or WORLD_SIZE=1) is `SINGLE`: no torch.distributed at all.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quantkit.errors import ConfigError, OutputError

TIMEOUT_S = 1800  # a collective waits this long for a peer (QUANTKIT_DIST_TIMEOUT overrides), then fails


RESUME = "the completed layers are saved: see the failing rank's log, then rerun the same command with --resume"


@dataclass(frozen=True)
class Group:
    """This process's place in the job. world 1: a plain single-process convert."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None  # gloo | nccl, None when single
    after_failure: str = RESUME  # what a user does when a peer is lost (validate: rerun; it is not resumable)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that writes files, saves the resume state and prints progress."""
        return self.rank == 0

    def barrier(self, what: str = "waiting for the other ranks") -> None:
        if self.distributed:
            import torch.distributed as dist

            with peers(self, what):
                dist.barrier()

    def all_gather_object(self, obj, what: str = "exchanging results") -> list:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        with peers(self, what):
            dist.all_gather_object(out, obj)
        return out

    def comm_device(self, dev: torch.device) -> torch.device:
        """Where tensors must be for a collective: NCCL's on this rank's GPU, gloo's on the host."""
        return dev if self.backend == "nccl" else torch.device("cpu")

    def batch_owner(self, i: int) -> int:
        """The rank that computes calibration micro-batch i (attention, expert outputs): i % world,
        fixed for the whole run, so a DSA micro-batch's selection (kept from one layer to the next)
        is always on the rank that uses it."""
        return i % self.world

    def owns_batch(self, i: int) -> bool:
        return self.batch_owner(i) == self.rank


SINGLE = Group()


class PeerLost(OutputError):
    """A collective failed: another rank died (its connection closed) or stopped answering."""


@contextlib.contextmanager
def peers(g: Group, what: str):
    """Turn a failed collective into one line that says what happened and what to do. gloo and
    NCCL raise RuntimeError (DistBackendError is one) when a peer's connection closes or the
    timeout passes; torchrun's agent then stops every rank, so the job never hangs."""
    try:
        yield
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)[:200]  # gloo prefixes its source file and line
        raise PeerLost(f"rank {g.rank} of {g.world}: {what}: another rank died or did not answer within "
                       f"{timeout_s():.0f}s (QUANTKIT_DIST_TIMEOUT; {first}); {g.after_failure}") from None


def from_env() -> Group:
    """The group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK), without
    joining it; SINGLE outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    try:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    except KeyError as e:
        raise ConfigError(f"WORLD_SIZE={world} but {e.args[0]} is not set: start a multi-rank convert with "
                          "`torchrun --nproc-per-node N -m quantkit convert ...` or `quantkit convert --nproc N`") from None
    return Group(rank=rank, world=world, local_rank=local)


def timeout_s() -> float:
    return float(os.environ.get("QUANTKIT_DIST_TIMEOUT", TIMEOUT_S))


def joined() -> bool:
    """Whether this process is already in a process group (validate after a multi-rank convert)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def init(device: torch.device) -> tuple[Group, torch.device]:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU) with a finite collective timeout,
    so that a dead or stuck peer becomes an error rather than a hang. Returns the group and this
    rank's compute device (cuda:LOCAL_RANK on a GPU). Single process: (SINGLE, device) untouched."""
    g = from_env()
    if not g.distributed:
        return SINGLE, device
    import torch.distributed as dist

    if device.type == "cuda":
        if device.index is not None and g.world > 1:
            raise ConfigError(f"--device {device}: with several ranks each uses cuda:LOCAL_RANK; pass --device cuda")
        if g.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"rank {g.rank}: LOCAL_RANK {g.local_rank} but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s); use --nproc-per-node <= that")
        device = torch.device("cuda", g.local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s()),
                                **({"device_id": device} if backend == "nccl" else {}))
    return Group(rank=g.rank, world=g.world, local_rank=g.local_rank, backend=backend), device


def close(g: Group) -> None:
    if g.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def check_shared_folder(g: Group, folder) -> None:
    """Every rank must see the output folder rank 0 sees: each saves its parts there, and rank 0
    renames them all in the finish. On several nodes with node-local disks the parts would be
    scattered and the finish would fail after the whole conversion; this fails at the start,
    naming the ranks that do not see rank 0's marker file."""
    if not g.distributed:
        return
    import secrets
    from pathlib import Path

    marker = Path(folder) / f".quantkit-ranks-{g.all_gather_object(secrets.token_hex(8), 'the output folder')[0]}"
    if g.leader:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("every rank of a multi-rank convert must see this file\n")
    g.barrier("the output folder")
    seen = g.all_gather_object(marker.is_file(), "the output folder")
    g.barrier("the output folder")
    if g.leader:
        marker.unlink()
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise ConfigError(f"{folder}: rank(s) {blind} do not see what rank 0 writes there; with several nodes, --out "
                          "(and the source) must be on a filesystem every node mounts (NFS, Lustre, ...)")


# ---- who quantizes what ------------------------------------------------------------------------
def partition(counts: dict[int, int], world: int, fixed: float = 0.0) -> dict[int, int]:
    """expert -> rank, balancing the work: greedy longest-processing-time over the experts' costs
    `counts[e] + fixed` (routed tokens, plus GPTQ's per-expert work expressed in tokens: an expert's
    Hessians grow with its tokens, its factorization does not). Largest first, ties by expert index,
    each to the least-loaded rank (ties by rank): deterministic, so every rank computes the same map
    from the same counts. LPT's makespan is within 4/3 of the optimum."""
    load = [0.0] * world
    owner: dict[int, int] = {}
    for e in sorted(counts, key=lambda e: (-(counts[e] + fixed), e)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[e] = r
        load[r] += counts[e] + fixed
    return owner


def check_same(g: Group, value: torch.Tensor, what: str) -> None:
    """Raise when ranks disagree on `value` (e.g. a layer's routing counts): the redundant attention
    was meant to give every rank the same h, and a partition built on different counts would leave
    experts to no rank or two. Happens only with non-deterministic kernels."""
    if not g.distributed:
        return
    seen = g.all_gather_object(value.detach().cpu().tolist(), what)
    if any(s != seen[0] for s in seen):
        bad = [r for r, s in enumerate(seen) if s != seen[0]]
        raise OutputError(f"{what}: ranks {bad} computed different values from rank 0 (non-deterministic kernels?); "
                          "run single-process, or report this with the device and torch version")


# ---- the token split: each micro-batch computed by one rank, then given to all -----------------
def _broadcast(g: Group, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, src: int,
               dev: torch.device, what: str) -> torch.Tensor:
    """`t` (on rank `src`; None elsewhere) on every rank, bit for bit: sent as its raw bytes, so any
    dtype travels over any backend (gloo has no bfloat16 reductions, bytes need none)."""
    import torch.distributed as dist

    cdev = g.comm_device(dev)
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if g.rank == src:
        buf = t.detach().to(cdev, dtype).contiguous().reshape(-1).view(torch.uint8)
    else:
        buf = torch.empty(n, dtype=torch.uint8, device=cdev)
    with peers(g, what):
        dist.broadcast(buf, src=src)
    return t if g.rank == src else buf.view(dtype).reshape(shape).to(dev)


def share_rows(g: Group, store, arrays: list, what: str) -> None:
    """Every micro-batch's rows of the store's `arrays` (TokenArray: h, x) from the rank that
    computed them (Group.batch_owner) to all ranks, in the stored dtype (float32 read back from
    the store and cast to its dtype is exact), so every rank again holds the whole store."""
    if not g.distributed:
        return
    for i, sl in enumerate(store.slices()):
        src = g.batch_owner(i)
        for arr in arrays:
            shape = (sl.stop - sl.start, *arr.shape[1:])  # (B, T, D)
            mine = arr.read(sl) if g.rank == src else None
            got = _broadcast(g, mine, shape, arr.dtype, src, store.compute, f"{what}: micro-batch {i} from rank {src}")
            if g.rank != src:
                arr.write(sl, got)
            del mine, got


def share_list(g: Group, items: list, dev: torch.device, what: str) -> list:
    """items[i] (a tensor or None: a micro-batch's routing ids, weights or DSA selection), known
    only on rank batch_owner(i), on every rank. Shapes and dtypes travel first (a few bytes each)."""
    if not g.distributed:
        return items
    local = {i: (tuple(t.shape), t.dtype) if t is not None else None for i, t in enumerate(items) if g.owns_batch(i)}
    metas: dict = {}
    for part in g.all_gather_object(local, f"{what}: shapes"):
        metas.update(part)
    out = []
    for i, t in enumerate(items):
        if metas[i] is None:
            out.append(None)
            continue
        shape, dtype = metas[i]
        out.append(_broadcast(g, t, shape, dtype, g.batch_owner(i), dev, f"{what}: micro-batch {i}"))
    return out


def max_kv(g: Group, kv, layer: int) -> None:
    """Combine one layer's KV-cache absolute maxima (quantkit.model.kvcache.KVAbsmax: each rank measured
    its own micro-batches) into the maximum over all tokens, on every rank. max is exact and
    order-free, so the scale equals a single process's. A rank that had no micro-batch has none."""
    if not g.distributed:
        return
    seen = g.all_gather_object(kv.maxima.get(layer), f"layer {layer}: KV-cache maxima")  # name -> max |x|, or None
    merged: dict[str, float] = {}
    for maxima in seen:
        for name, v in (maxima or {}).items():
            merged[name] = max(merged.get(name, v), v)
    if merged:
        kv.maxima[layer] = merged


def share_expert_rows(g: Group, mine: dict[int, torch.Tensor], owner: dict[int, int], counts: list[int], width: int,
                      dtype: torch.dtype, dev: torch.device, what: str) -> dict[int, torch.Tensor]:
    """Every routed expert's weighted output rows (counts[e], width) on every rank, from the rank
    that computed them (`owner`, validate's expert split; `mine`: this rank's). One broadcast per
    rank: its experts' rows concatenated in ascending expert order, as raw bytes; receivers size
    them from the routing counts, which every rank computed from the same hidden states."""
    out: dict[int, torch.Tensor] = {}
    for r in range(g.world):
        es = [e for e in sorted(owner) if owner[e] == r and counts[e] > 0]
        if not es:
            continue
        n = sum(counts[e] for e in es)
        t = torch.cat([mine[e] for e in es]) if r == g.rank else None  # (n, width)
        got = _broadcast(g, t, (n, width), dtype, r, dev, f"{what} from rank {r}")
        at = 0
        for e in es:
            out[e] = got[at:at + counts[e]]
            at += counts[e]
    return out


# ---- the exchange ------------------------------------------------------------------------------
def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _unpack(buf: torch.Tensor, meta: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    out, at = [], 0
    for shape, dtype in meta:
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        out.append(buf[at:at + n].clone().view(dtype).reshape(shape))  # clone: an aligned, owned copy
        at += n
    return out


def exchange_experts(g: Group, owner: dict[int, int], mine: dict[int, dict], dev: torch.device,
                     wrap: Callable[[torch.Tensor, torch.Tensor], Any]) -> dict[int, dict]:
    """Give every rank every expert's quantized weights: `mine` holds this rank's results
    (expert -> {proj: a weight with .q and .scale}); each expert's tensors go out from its owner as
    one byte buffer (one broadcast per expert, in ascending expert order on every rank). Returns all
    experts' results, on `dev`; a received one is `wrap(q, scale)` (the caller's QuantizedWeight:
    this module knows bytes, not quantization)."""
    if not g.distributed:
        return dict(mine)
    import torch.distributed as dist

    cdev = g.comm_device(dev)
    # shapes and dtypes first (a few hundred bytes per expert), so that receivers can allocate
    local = {e: [(p, tuple(q.q.shape), q.q.dtype, tuple(q.scale.shape), q.scale.dtype) for p, q in sorted(qs.items())]
             for e, qs in mine.items()}
    metas: dict[int, list] = {}
    for part in g.all_gather_object(local, "exchanging quantized experts' shapes"):
        metas.update(part)
    missing = sorted(set(owner) - set(metas))
    if missing:
        raise OutputError(f"experts {missing}: no rank quantized them (the partition and the ranks' results disagree)")
    result: dict[int, dict] = {}
    for e in sorted(owner):
        layout = [(s, d) for _, qs, qd, ss, sd in metas[e] for s, d in ((qs, qd), (ss, sd))]
        if owner[e] == g.rank:
            qs = mine[e]
            buf = _pack([t for p, *_ in metas[e] for t in (qs[p].q, qs[p].scale)]).to(cdev)
        else:
            size = sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in layout)
            buf = torch.empty(size, dtype=torch.uint8, device=cdev)
        with peers(g, f"receiving expert {e} from rank {owner[e]}"):
            dist.broadcast(buf, src=owner[e])
        if owner[e] == g.rank:
            result[e] = mine[e]
        else:
            ts = _unpack(buf, layout)
            result[e] = {p: wrap(ts[2 * i].to(dev), ts[2 * i + 1].to(dev)) for i, (p, *_) in enumerate(metas[e])}
        del buf
    return result


def exchange_records(g: Group, records: list) -> list:
    """Every rank's ExpertRecords, merged in expert order."""
    if not g.distributed:
        return records
    merged = [r for part in g.all_gather_object(records, "exchanging expert records") for r in part]
    return sorted(merged, key=lambda r: r.expert)
