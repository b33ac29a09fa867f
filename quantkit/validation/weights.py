"""How validate holds the checkpoints' weights: which routed experts each rank runs (convert's
partition), what share of the three checkpoints a rank reads, how much of it stays in memory as
stored after the first read (`--weights auto|resident|stream`), the expert chunk, and
validation.json's `weights` record of all that per rank."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.errors import ConfigError

if TYPE_CHECKING:
    from quantkit.runtime.distributed import Group


__all__ = ["WEIGHTS", "expert_owners", "weights_plan", "weights_report"]

WEIGHTS = ("auto", "resident", "stream")


def expert_owners(arch, report: dict | None, group: Group) -> dict[int, dict[int, int]] | None:
    """layer -> expert -> rank for every MoE layer, as convert partitions them (quantkit.runtime.distributed.
    partition over the routed calibration tokens the report records, plus GPTQ's fixed cost);
    experts with no record count 0 tokens. None for a single process."""
    if not group.distributed:
        return None
    from quantkit.planner.budgets import expert_fixed_tokens
    from quantkit.runtime.distributed import partition

    tokens = {(e["layer"], e["expert"]): e.get("tokens", 0) for e in (report or {}).get("experts") or []}
    fixed = expert_fixed_tokens(arch)
    return {layer: partition({e: tokens.get((layer, e), 0) for e in range(arch.n_routed_experts)}, group.world, fixed)
            for layer in range(arch.num_hidden_layers) if arch.is_moe(layer)}


def weights_plan(ckpts: dict[str, Checkpoint], owners, group: Group, dev: torch.device, weights: str, max_host_memory,
                 max_gpu_memory, exchange: int, long_len: int = 0) -> dict:
    """What this rank reads and what it keeps. Its share: the decoder layers' tensors but the routed
    experts of other ranks, and the embedding, norm and head. `auto` keeps as much of the share as
    fits (the shared tensors first, then the experts layer by layer) on `dev` beside the layer
    loop's working set (quantkit.planner.cost.validate_room), and on a GPU then in this rank's part of host
    memory; `resident` insists on all of it; `stream` keeps nothing. Kept tensors stay as stored
    from their first read (Checkpoint.keep), so a greedy token re-reads only what was not kept. The
    expert chunk is sized from what is left on `dev`. `long_len`: the long-context pass's window length,
    whose activations the room on `dev` leaves space for (quantkit.planner.budgets.long_pass_bytes)."""
    from quantkit.model.tensors import TensorClass
    from quantkit.planner.budgets import long_pass_bytes, validate_budget, validate_expert_chunk, validate_room

    arch = ckpts["reference"].arch
    L = arch.num_hidden_layers

    def mine(info) -> bool:
        if info.layer is None:
            return True
        if info.layer > L:  # an MTP layer past the first: validate does not run it
            return False
        if info.layer == L:  # the first MTP layer: every rank runs all of it, once (quantkit.validation.mtprow)
            return True
        return info.klass != TensorClass.ROUTED_EXPERT or owners is None or owners[info.layer][info.expert] == group.rank

    def order(item) -> tuple:
        (m, n), info = item, ckpts[item[0]].tensors[item[1]].info
        return (info.klass == TensorClass.ROUTED_EXPERT, -1 if info.layer is None else info.layer, info.expert or 0, m, n)

    share = sorted(((m, n) for m, ck in ckpts.items() for n in ck.names() if mine(ck.tensors[n].info)),
                   key=lambda item: order(item))
    sizes = {(m, n): ckpts[m].storage_bytes(n) for m, n in share}
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", group.world)) if group.distributed else 1
    budget = validate_budget(dev.type, max_host_memory, max_gpu_memory, ranks_here)
    tiers = [[dev, validate_room(arch, dev.type, budget, exchange, long_len), 0]] if weights != "stream" else []
    if dev.type == "cuda" and weights != "stream":  # then this rank's part of host memory
        tiers.append([torch.device("cpu"), validate_room(arch, "cpu", validate_budget("cpu", max_host_memory, None, ranks_here)), 0])
    for item in share:
        tier = next((t for t in tiers if t[2] + sizes[item] <= t[1]), None)
        if tier is None:
            break  # keep a prefix: whole layers' shared tensors before any expert
        tier[2] += sizes[item]
        ckpts[item[0]].keep([item[1]], tier[0])
    kept = sum(t[2] for t in tiers)
    total = sum(sizes.values())
    if weights == "resident" and kept < total:
        raise ConfigError(f"--weights resident: this rank's share of the three checkpoints is {total / 1e9:.2f} GB as "
                          f"stored, but its budget keeps {kept / 1e9:.2f} GB beside the layer loop; use more ranks "
                          "(quantkit validate --nproc N), a larger --max-host-memory/--max-gpu-memory, or --weights auto")
    on_dev = tiers[0][2] if tiers else 0
    chunk = validate_expert_chunk(arch, dev.type, max_host_memory, max_gpu_memory, kept=on_dev, ranks_here=ranks_here,
                                  exchange=exchange + long_pass_bytes(arch, long_len))
    experts = sum(1 for m, n in share if ckpts[m].tensors[n].info.klass == TensorClass.ROUTED_EXPERT
                  and ckpts[m].tensors[n].info.proj == "down_proj" and ckpts[m].tensors[n].info.layer < L)  # the split ones
    return {"share_bytes": total, "kept_bytes": kept, "kept_on_device_bytes": on_dev if dev.type == "cuda" else 0,
            "budget_bytes": budget, "chunk": chunk, "experts": experts}


def weights_report(ranks: list[dict], group: Group) -> dict:
    """validation.json's `weights`: how the weights were held and read, per rank."""
    mode = ("resident" if all(r["kept_bytes"] == r["share_bytes"] for r in ranks) else
            "stream" if not any(r["kept_bytes"] for r in ranks) else "partly resident")
    return {"mode": mode, "world": group.world,
            **({"backend": group.backend} if group.distributed else {}),
            "share_bytes_per_rank": [r["share_bytes"] for r in ranks],
            "kept_bytes_per_rank": [r["kept_bytes"] for r in ranks],
            "kept_on_device_bytes_per_rank": [r["kept_on_device_bytes"] for r in ranks],
            "read_bytes_per_rank": [r["read_bytes"] for r in ranks],
            "experts_per_rank": [r["experts"] for r in ranks],
            "expert_chunk_per_rank": [r["chunk"] for r in ranks],
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
            "note": "share: what a rank reads (its own routed experts only); kept: what it keeps in memory as stored "
                    "after the first read; every pass (the prompt pass, then each greedy token) re-reads the rest"}
