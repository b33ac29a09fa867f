"""Streaming forward over checkpoints: embed, then one decoder layer at a time, then the head.

Peak memory is one layer's weights (its routed experts a chunk at a time, quantkit.validation.layerstream)
plus the activations, whatever the depth. `step` is the one forward loop: `logits`/`run` drive
it with one stream, `validate` with many in lockstep (the source, both outputs, the cross-phase
and FP8-KV paths), each checkpoint's layer loaded once for all the streams that run it.
`convert` has its own visible loop because it quantizes and writes between the two halves of
each layer; its attention half is the same reference code (quantkit.conversion.layerpass.attention_pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.model.ops import rms_norm
from quantkit.model.reference import Context, LayerCache, head_weight_name
from quantkit.runtime.device import resolve_device

if TYPE_CHECKING:
    from quantkit.runtime.distributed import Group


@dataclass
class Stream:
    """One sequence of forward passes: whose weights it runs and the caches it extends."""

    name: str
    model: str  # key of the checkpoint whose weights it runs
    caches: list[LayerCache] | None  # None: no cache (one full-sequence pass)
    ids: torch.Tensor | None = None  # (B, T) tokens fed at the current step
    kv: Any = None  # quantkit.model.kvcache.KVCache: how this stream's KV cache stores values (None: as computed)
    options: dict[str, Any] = field(default_factory=dict)  # Context options (dsa_dense, dsa_ties)
    h: torch.Tensor | None = field(default=None, repr=False)  # (B, T, D)
    ctx: Context | None = field(default=None, repr=False)
    tokens: list[torch.Tensor] = field(default_factory=list, repr=False)  # generated, each (B,)


def fork(caches: list[LayerCache]) -> list[LayerCache]:
    """Caches that continue from the same prefix independently (appends make new tensors)."""
    return [c.copy() for c in caches]


def new_caches(ckpt: Checkpoint) -> list[LayerCache]:
    return [LayerCache() for _ in range(ckpt.arch.num_hidden_layers)]


def embed(ckpt: Checkpoint, input_ids: torch.Tensor, device, dtype) -> torch.Tensor:
    """Hidden states (B, T, D) on `device`. The lookup runs where the checkpoint puts the table (vocab x
    D, gigabytes at full scale: the host, unless validate keeps it resident on the device), so only
    the B x T x D result crosses."""
    table = ckpt.get(f"{ckpt.arch.prefix}embed_tokens.weight", dtype)
    return torch.nn.functional.embedding(input_ids.to(table.device), table).to(device)  # (B, T, D)


def heads(ckpt: Checkpoint, hs: list[torch.Tensor], dtype) -> list[torch.Tensor]:
    """Logits (B, T, V) for each hidden state, the final norm and head weights loaded once."""
    a = ckpt.arch
    norm = ckpt.get(f"{a.prefix}norm.weight", dtype)
    w = ckpt.get(head_weight_name(a), dtype)
    return [torch.nn.functional.linear(rms_norm(h, norm.to(h.device), a.rms_norm_eps), w.to(h.device)) for h in hs]


def head(ckpt: Checkpoint, h: torch.Tensor, dtype) -> torch.Tensor:
    return heads(ckpt, [h], dtype)[0]


def layer_weights(ckpt: Checkpoint, layer: int, device, dtype) -> dict[str, torch.Tensor]:
    """A whole decoder layer's weights (tests' oracle for the streamed layer)."""
    return {k: v.to(device) for k, v in ckpt.layer(layer, dtype).items()}


def step(ckpts: dict[str, Checkpoint], streams: list[Stream], device, dtype, on_layer=None, advance=None,
         chunk: int = 16, group: Group | None = None, owners: dict[int, dict[int, int]] | None = None) -> None:
    """One forward of every stream over its `ids`, in lockstep: layer i of every checkpoint runs
    before layer i+1 of any; each checkpoint's layer is loaded once for all its streams, then freed.
    Leaves each stream's final hidden state in `h`; `on_layer(layer, {name: h})` sees every layer.
    Routed experts are loaded `chunk` at a time (quantkit.validation.layerstream), as convert does; with a
    multi-rank `group`, only this rank's (`owners[layer]`: expert -> rank), the others' outputs received."""
    from quantkit.validation.layerstream import streamed_layer

    by_model = {m: [s for s in streams if s.model == m] for m in ckpts}
    by_model = {m: g for m, g in by_model.items() if g}
    for m, members in by_model.items():
        table = ckpts[m].get(f"{ckpts[m].arch.prefix}embed_tokens.weight", dtype)
        for s in members:
            start = s.caches[0].length if s.caches else 0
            s.ctx = Context.build(ckpts[m].arch, s.ids.shape[1], device, dtype, start=start, caches=s.caches, kv=s.kv,
                                  **s.options)
            s.h = torch.nn.functional.embedding(s.ids.to(table.device), table).to(device)  # (B, T, D)
        del table
    for layer in range(next(iter(ckpts.values())).arch.num_hidden_layers):
        for m, members in by_model.items():
            hs = streamed_layer(ckpts[m], layer, [s.h for s in members], [s.ctx for s in members], device, dtype, chunk,
                                group, (owners or {}).get(layer))
            for s, h in zip(members, hs):
                s.h = h
            if advance:
                advance()
        if on_layer is not None:
            on_layer(layer, {s.name: s.h for s in streams})


def run(
    ckpt: Checkpoint,
    input_ids: torch.Tensor,
    *,
    device: str | torch.device = "auto",
    dtype: torch.dtype = torch.float32,
    caches: list[LayerCache] | None = None,
    on_layer=None,
    chunk: int = 16,
    **options,
) -> torch.Tensor:
    """Logits (B, T, V) for `input_ids` (B, T), continuing `caches` when given (incremental decode).

    `on_layer(layer, hidden)` is called after every decoder layer (validation records errors there).
    `options` go to the reference Context (`dsa_dense`, `dsa_ties`).
    """
    device = resolve_device(device)
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    s = Stream("run", "model", caches, ids=input_ids, options=options)
    seen = None if on_layer is None else (lambda layer, hs: on_layer(layer, hs["run"]))
    with torch.no_grad():
        step({"model": ckpt}, [s], device, dtype, seen, chunk=chunk)
        return head(ckpt, s.h, dtype)


def logits(model: str | Path | Checkpoint, input_ids, device: str = "auto", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits of `model` (a folder or `tiny:kimi-k2.6` / `tiny:glm-5.2`) on `input_ids` (T,) or (B, T).

    Runs layer by layer from the checkpoint on CUDA when available (device="auto"), else CPU.

    Example:
        >>> import quantkit as qk, torch
        >>> qk.logits("tiny:glm-5.2", torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3, 512])
    """
    from quantkit.inputs.modelspec import open_checkpoint

    ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
    return run(ckpt, input_ids, device=device, dtype=dtype)
