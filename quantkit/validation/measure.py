"""validate's measurement: every stream in lockstep, its numbers taken as each layer finishes.

`measure` is three steps:

    prompt pass    every eval window through every checkpoint (and, with an FP8 KV cache, the decode
                   and prefill checkpoints once more per scale variant): per-layer error, KL, top-1,
                   perplexity; the last position's logits pick each stream's first token
    decode steps   K - 1 more tokens: free-running greedy streams (each checkpoint alone, and the
                   cross-phase path: the prefill checkpoint's caches, the decode checkpoint's weights)
                   and teacher-forced ones fed the reference's tokens, whose KL, top-1 and per-layer
                   error add up step by step
    MTP row        each checkpoint's MTP layer on its own prompt-pass last hidden states
                   (quantkit.validation.mtprow)
    rows           the greedy agreement of every continuation, and for a pair the cross-phase row
                   (with INT4-only decoding as its baseline) and the FP8-KV rows (quantkit.validation.kvrows)

`cross_phase_logits` is the cross-phase path on its own (the tests' independent check).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.runtime import faults
from quantkit.runtime.device import resolve_device
from quantkit.validation.forward import Stream, fork, heads, new_caches, step
from quantkit.validation.kvrows import kv_rows
from quantkit.validation.metrics import agreement, kl_top1, mean_nll, token_kl
from quantkit.validation.mtprow import mtp_measure

if TYPE_CHECKING:
    from quantkit.runtime.distributed import Group


__all__ = ["cross_phase_logits", "measure"]


def measure(ckpts: dict[str, Checkpoint], ids: torch.Tensor, K: int, pair: bool, device, dtype, bar,
            kv: dict[str, Any] | None = None, kv_calibrated: bool = False, chunk: int = 16, group: Group | None = None,
            owners: dict[int, dict[int, int]] | None = None) -> dict:
    """Run every stream in lockstep and return the rows, per-layer curves and continuations.
    `kv`: variant -> quantkit.model.kvcache.KVCache; each adds the FP8-KV rows' streams (pairs only).
    Routed experts are loaded `chunk` at a time (quantkit.validation.layerstream); with several ranks, each
    computes those `owners` gives it (layer -> expert -> rank)."""
    run = _Lockstep(ckpts, device, dtype, bar, chunk, group, owners)
    models = [m for m in ckpts if m != "reference"]
    kv = kv if pair and K > 1 else {}

    prompt = _prompt_streams(ckpts, ids, kv)
    rows, ref_nll, last = _prompt_pass(run, prompt, models, ids, kv)
    mtp = mtp_measure(ckpts, {m: prompt[m].h for m in ckpts}, ids, models, device, dtype, chunk, group)
    for s in prompt.values():
        s.h = None
    result = {"rows": rows, "reference": {"ppl": math.exp(ref_nll)}, "mtp": mtp, "continuations": {}}
    if K == 0:
        return result

    free, forced = _decode_streams(prompt, models, last, pair, kv)
    sums = _decode_steps(run, free, forced, K)
    cont = {name: torch.stack(s.tokens, dim=1) for name, s in free.items()}  # (B, K)
    for m in models:
        agree, exact = agreement(cont[m], cont["reference"])
        rows[m]["metrics"].update(greedy_agree=agree, greedy_exact=exact)
    if pair:
        rows.update(_step_rows(sums, cont, ids.shape[0] * (K - 1), K, kv, kv_calibrated))
    result["continuations"] = {name: t.tolist() for name, t in cont.items()}
    return result


@dataclass
class _Lockstep:
    """How every pass of one measurement runs: the checkpoints, where, and the routed experts' split."""

    ckpts: dict[str, Checkpoint]
    device: Any
    dtype: torch.dtype
    bar: Any  # quantkit.runtime.progress.LayerProgress: advanced once per checkpoint layer
    chunk: int
    group: Group | None
    owners: dict[int, dict[int, int]] | None

    @property
    def num_layers(self) -> int:
        return self.ckpts["reference"].arch.num_hidden_layers

    def forward(self, streams: list[Stream], on_layer) -> None:
        """One forward of every stream over its `ids` (quantkit.validation.forward.step)."""
        step(self.ckpts, streams, self.device, self.dtype, on_layer, self.bar.advance, self.chunk, self.group, self.owners)

    def last_logits(self, streams: list[Stream]) -> dict[str, torch.Tensor]:
        """stream name -> (B, V) logits of its last position, each checkpoint's head loaded once."""
        logits = {}
        for m, ck in self.ckpts.items():
            members = [s for s in streams if s.model == m]
            for s, lg in zip(members, heads(ck, [s.h for s in members], self.dtype)):
                logits[s.name] = lg[:, -1]  # (B, V)
        return logits


class _LayerErr:
    """Per-layer sum of ||h - h_ref||^2 and ||h_ref||^2 (float64), over every step it is fed."""

    def __init__(self, n_layers: int):
        self.diff = [0.0] * n_layers
        self.ref = [0.0] * n_layers

    def add(self, layer: int, h: torch.Tensor, h_ref: torch.Tensor) -> None:
        self.diff[layer] += float((h.double() - h_ref.double()).pow(2).sum())
        self.ref[layer] += float(h_ref.double().pow(2).sum())

    def rel(self) -> list[float]:
        return [math.sqrt(d / r) if r > 0 else 0.0 for d, r in zip(self.diff, self.ref)]


# ---- 1. the prompt pass ------------------------------------------------------------------------------
def _prompt_streams(ckpts: dict[str, Checkpoint], ids: torch.Tensor, kv: dict[str, Any]) -> dict[str, Stream]:
    """Every eval window through every checkpoint; with an FP8 KV cache, the decode and prefill
    checkpoints once more per scale variant, storing their caches as the engines do."""
    prompt = {m: Stream(m, m, new_caches(ckpts[m]), ids=ids) for m in ckpts}
    for v, spec in kv.items():
        for m in ("decode", "prefill"):
            prompt[f"{m}+kv{v}"] = Stream(f"{m}+kv{v}", m, new_caches(ckpts[m]), ids=ids, kv=spec)
    return prompt


def _prompt_pass(run: _Lockstep, prompt: dict[str, Stream], models: list[str], ids: torch.Tensor,
                 kv: dict[str, Any]) -> tuple[dict[str, dict], float, dict[str, torch.Tensor]]:
    """(the prompt-pass rows, the reference's mean NLL, stream -> its last position's logits)."""
    errs = {m: _LayerErr(run.num_layers) for m in models}

    def on_prompt_layer(layer, hs):
        faults.point("validate:layer")  # the multi-rank tests kill a rank here
        for m in models:
            errs[m].add(layer, hs[m], hs["reference"])

    run.forward(list(prompt.values()), on_prompt_layer)
    ckpts, dtype = run.ckpts, run.dtype
    (ref_logits,) = heads(ckpts["reference"], [prompt["reference"].h], dtype)
    ref_nll = mean_nll(ref_logits, ids)
    last = {"reference": ref_logits[:, -1]}
    rows: dict[str, dict] = {}
    for m in models:
        (logits,) = heads(ckpts[m], [prompt[m].h], dtype)
        rows[m] = _prompt_row(ref_logits, logits, ids, ref_nll, errs[m].rel())
        last[m] = logits[:, -1]
        del logits
    for v in kv:
        for m in ("decode", "prefill"):
            s = prompt[f"{m}+kv{v}"]
            last[s.name] = heads(ckpts[m], [s.h[:, -1:]], dtype)[0][:, -1]
    return rows, ref_nll, last  # the streams' h stay for the MTP row (measure clears them)


def _prompt_row(ref_logits: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, ref_nll: float, curve: list[float]) -> dict:
    kl, agree, n = kl_top1(ref_logits, logits)
    nll = mean_nll(logits, ids)
    return {
        "metrics": {"kl": kl / n, "top1": agree / n, "ppl": math.exp(nll),
                    "ppl_delta": math.exp(nll - ref_nll) - 1, "layer_rel_err": max(curve)},
        "layers": curve,
        "measured_on": "eval windows (prompt pass)",
    }


# ---- 2. the decode steps ------------------------------------------------------------------------------
def _decode_streams(prompt: dict[str, Stream], models: list[str], last: dict[str, torch.Tensor], pair: bool,
                    kv: dict[str, Any]) -> tuple[dict[str, Stream], dict[str, Stream]]:
    """(free-running greedy streams, teacher-forced streams fed the reference's tokens), each going on
    from the prompt pass's caches with the first token the prompt pass picked."""
    first = {m: last[m].argmax(-1).cpu() for m in last}  # the prompt pass picks the first token
    free = {"reference": Stream("reference", "reference", prompt["reference"].caches, tokens=[first["reference"]])}
    for m in models:
        free[m] = Stream(m, m, prompt[m].caches, tokens=[first[m]])
    forced: dict[str, Stream] = {}
    if pair:
        # the servers' path: the prefill pool writes the caches and samples token 1, the decode pool
        # goes on from those caches (both cross-phase streams start from this one hand-over)
        handed_over = prompt["prefill"].caches
        free["cross_phase"] = Stream("cross_phase", "decode", fork(handed_over), tokens=[first["prefill"]])
        forced = {"cross_phase": Stream("cross_phase@tf", "decode", fork(handed_over)),
                  "int4_only": Stream("int4_only@tf", "decode", fork(prompt["decode"].caches))}
        for v, spec in kv.items():  # the same two paths over caches stored in FP8, read in FP8
            dec, pre = prompt[f"decode+kv{v}"], prompt[f"prefill+kv{v}"]
            free[f"decode_kv{v}"] = Stream(f"decode_kv{v}", "decode", dec.caches, tokens=[first[dec.name]], kv=spec)
            free[f"cross_phase_kv{v}"] = Stream(f"cross_phase_kv{v}", "decode", fork(pre.caches),
                                                tokens=[first[pre.name]], kv=spec)
            forced[f"decode_kv{v}"] = Stream(f"decode_kv{v}@tf", "decode", fork(dec.caches), kv=spec)
            forced[f"cross_phase_kv{v}"] = Stream(f"cross_phase_kv{v}@tf", "decode", fork(pre.caches), kv=spec)
    return free, forced


class _StepSums:
    """What the teacher-forced streams' decode steps add up to, per stream: per-layer error, KL and
    top-1 sums, and every step's per-position KL (for paired differences)."""

    def __init__(self, forced: dict[str, Stream], n_layers: int):
        self.err = {k: _LayerErr(n_layers) for k in forced}
        self.kl = {k: 0.0 for k in forced}
        self.top1 = {k: 0.0 for k in forced}
        self.each: dict[str, list[torch.Tensor]] = {k: [] for k in forced}

    def add(self, k: str, ref: torch.Tensor, logits: torch.Tensor) -> None:
        """One decode step's (B, V) logits of stream `k` against the reference's."""
        kl, agree, _ = kl_top1(ref[:, None], logits[:, None])
        self.kl[k] += kl
        self.top1[k] += agree
        self.each[k].append(token_kl(ref, logits).cpu())


def _decode_steps(run: _Lockstep, free: dict[str, Stream], forced: dict[str, Stream], K: int) -> _StepSums:
    """K - 1 lockstep steps: each free stream feeds its own last token, each forced one the reference's."""
    sums = _StepSums(forced, run.num_layers)

    def on_step_layer(layer, hs):
        for k, s in forced.items():
            sums.err[k].add(layer, hs[s.name], hs["reference"])

    for _ in range(K - 1):
        for s in free.values():
            s.ids = s.tokens[-1][:, None]
        for s in forced.values():
            s.ids = free["reference"].tokens[-1][:, None]
        streams = list(free.values()) + list(forced.values())
        run.forward(streams, on_step_layer)
        logits = run.last_logits(streams)
        for s in free.values():
            s.tokens.append(logits[s.name].argmax(-1).cpu())
        for k, s in forced.items():
            sums.add(k, logits["reference"], logits[s.name])
    return sums


# ---- 3. the decode-step rows ----------------------------------------------------------------------------
def _step_rows(sums: _StepSums, cont: dict[str, torch.Tensor], n: int, K: int, kv: dict[str, Any],
               kv_calibrated: bool) -> dict[str, dict]:
    """The cross-phase row (INT4-only decoding over the same steps inside it) and the FP8-KV rows;
    `n` positions per teacher-forced stream (windows x decode steps)."""
    decode_steps = {}
    for k in sums.kl:
        curve = sums.err[k].rel()
        decode_steps[k] = {"kl": sums.kl[k] / n if n else None, "top1": sums.top1[k] / n if n else None,
                           "layer_rel_err": max(curve) if n else None, "layers": curve if n else []}
    agree, exact = agreement(cont["cross_phase"], cont["reference"])
    agree_int4, _ = agreement(cont["cross_phase"], cont["decode"])
    c = decode_steps["cross_phase"]
    rows = {"cross_phase": {
        "metrics": {"kl": c["kl"], "top1": c["top1"], "layer_rel_err": c["layer_rel_err"], "greedy_agree": agree,
                    "greedy_exact": exact, "greedy_agree_decode": agree_int4},
        "layers": c["layers"],
        "measured_on": f"{K - 1} decode steps after each eval window, fed the reference's continuation",
        "int4_only": decode_steps["int4_only"],  # the same steps over INT4's own caches: the baseline
    }}
    if kv:
        rows.update(kv_rows(kv, decode_steps, sums.each, cont, kv_calibrated))
    return rows


def cross_phase_logits(prefill: Checkpoint, decode: Checkpoint, prompt: torch.Tensor, tokens: torch.Tensor, *,
                       device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Logits (B, K, V) of decoding `tokens` (B, K) one at a time with the `decode` weights on top of
    the caches the `prefill` weights wrote for `prompt` (B, P): the path `validate` measures."""
    device = resolve_device(device)
    ckpts = {"prefill": prefill, "decode": decode}
    with torch.no_grad():
        pre = Stream("prefill", "prefill", new_caches(prefill), ids=prompt)
        step(ckpts, [pre], device, dtype)
        cross = Stream("cross_phase", "decode", fork(pre.caches))
        out = []
        for k in range(tokens.shape[1]):
            cross.ids = tokens[:, k: k + 1]
            step(ckpts, [cross], device, dtype)
            out.append(heads(decode, [cross.h], dtype)[0])
        return torch.cat(out, dim=1)
