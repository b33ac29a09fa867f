"""What each checkpoint of the pair would have answered: greedy continuations of the recorded prompts
through quantkit's streaming forward (quantkit.validation.forward.step: one decoder layer at a time,
each checkpoint's layer loaded once per step for every stream that runs it), with the log-probability
of every token the server named at that step, so the top-k KL needs no full-vocabulary tensors kept.

The candidates are what an endpoint could be running: the source, prefill/ (FP8), decode/ (INT4),
the disaggregated hand-over (prefill/ writes the cache, decode/ decodes on it), and the quantized
ones again with the KV cache stored in FP8 as the engines store it (quantkit.model.kvcache; vLLM's
fp8_ds_mla for DSA models, else fp8_e4m3 with the checkpoint's scales).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantkit.model.kvcache import KVCache
from quantkit.validation.forward import Stream, fork, heads, new_caches, step


@dataclass
class Candidate:
    key: str  # e.g. "decode+fp8kv"
    label: str  # what the verdict says, e.g. "decode/ INT4 + FP8 KV"
    prompt_model: str  # checkpoint that runs the prompt ("reference", "prefill", "decode")
    decode_model: str  # checkpoint that runs the generated tokens
    kv: KVCache | None = None


def candidates(pair: bool, has_dsa: bool, kv_cache_dtype: str = "auto") -> list[Candidate]:
    """The checkpoints (and KV variants) an endpoint is compared with; `kv_cache_dtype` bf16 drops the FP8 ones."""
    out = [Candidate("source", "source (the unquantized reference)", "reference", "reference")]
    if not pair:
        return out
    out += [Candidate("prefill", "prefill/ FP8", "prefill", "prefill"),
            Candidate("decode", "decode/ INT4", "decode", "decode"),
            Candidate("cross_phase", "prefill/ -> decode/ (disaggregated)", "prefill", "decode")]
    dtype = ("fp8_ds_mla" if has_dsa else "fp8_e4m3") if kv_cache_dtype == "auto" else kv_cache_dtype
    if dtype != "bf16":
        kv = KVCache(dtype, "checkpoint")
        out += [Candidate(c.key + "+fp8kv", f"{c.label} + FP8 KV ({dtype})", c.prompt_model, c.decode_model, kv)
                for c in out[1:]]
    return out


@dataclass
class Continuation:
    tokens: list[int]  # greedy tokens, up to and excluding the first end-of-sequence token
    stopped: bool  # ended on end-of-sequence before max_tokens
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per step: {token id: log p} for the ids asked


def keep_resident(ckpts: dict, device) -> int:
    """Keep as much of the checkpoints in memory, as stored, as validate's budget allows (validate's own
    plan, quantkit.validation.weights), so each greedy step re-reads only the rest; returns the expert chunk."""
    from quantkit.runtime.distributed import from_env
    from quantkit.validation.weights import weights_plan

    ordered = {"reference": ckpts["reference"]} | ckpts
    return weights_plan(ordered, None, from_env(), device, "auto", None, None, 0)["chunk"]


def variants(cands: list[Candidate], ckpts: dict, modes: tuple[str, ...], reopen) -> tuple[list[Candidate], dict, dict[str, list[str]]]:
    """Every candidate once per distinct computation among `modes` (quantkit.model.numerics.computation):
    (the candidates, the checkpoints they run keyed `model` for the first mode and `model@mode` for the
    others, each with its numerics set, checkpoint key -> its candidates' keys); `reopen(model)` opens another
    copy of a checkpoint (each copy computes in one numerics). One mode: the keys as before."""
    from quantkit.model.numerics import computation

    opened = {(m, modes[0]): ck for m, ck in ckpts.items()}
    out: list[Candidate] = []
    groups: dict[str, list[str]] = {}
    seen: dict[str, set[tuple]] = {}
    for c in cands:
        groups[c.key] = []
        for n in modes:
            sig = tuple(computation(ckpts[m], n) for m in (c.prompt_model, c.decode_model))
            if sig in seen.setdefault(c.key, set()):
                continue
            seen[c.key].add(sig)
            for m in (c.prompt_model, c.decode_model):
                if (m, n) not in opened:
                    opened[m, n] = reopen(m)
            key = c.key if len(modes) == 1 else f"{c.key}@{n}"
            pm, dm = ((m if n == modes[0] else f"{m}@{n}") for m in (c.prompt_model, c.decode_model))
            out.append(Candidate(key, c.label, pm, dm, c.kv))
            groups[c.key].append(key)
    models = {}
    for (m, n), ck in opened.items():
        ck.numerics = n
        models[m if n == modes[0] else f"{m}@{n}"] = ck
    return out, models, groups


def greedy(ckpts: dict, cands: list[Candidate], prompts: list[list[int]], max_tokens: int, wanted: list[list[set[int]]],
           eos: set[int], device, dtype=torch.float32, chunk: int = 16) -> dict[str, list[Continuation]]:
    """{candidate key: [Continuation per prompt]}: every candidate and prompt as its own stream, all advanced
    in lockstep; `wanted[p][k]` the token ids whose log-probability step k of prompt p must record."""
    streams: dict[tuple[str, int], Stream] = {}
    for c in cands:
        for i, ids in enumerate(prompts):
            streams[c.key, i] = Stream(f"{c.key}#{i}", c.prompt_model, new_caches(ckpts[c.prompt_model]),
                                       ids=torch.tensor([ids]), kv=c.kv)
    out = {c.key: [Continuation([], False) for _ in prompts] for c in cands}
    by_key = {c.key: c for c in cands}
    with torch.no_grad():
        for k in range(max_tokens):
            live = {sk: s for sk, s in streams.items() if not out[sk[0]][sk[1]].stopped}
            if not live:
                break
            step(ckpts, list(live.values()), device, dtype, chunk=chunk)
            for (key, i), s in live.items():
                lp = torch.log_softmax(heads(ckpts[s.model], [s.h[:, -1:]], dtype)[0][0, -1].float(), -1)  # (V,), on the device
                cont, tok = out[key][i], int(lp.argmax())
                want = sorted(t for t in (wanted[i][k] if k < len(wanted[i]) else set()) | {tok} if 0 <= t < lp.numel())
                cont.logprobs.append(dict(zip(want, lp[want].tolist())))  # only the ids asked for leave the device
                if tok in eos:
                    cont.stopped = True
                    continue
                cont.tokens.append(tok)
                c = by_key[key]
                if k == 0 and c.decode_model != c.prompt_model:  # the hand-over: decode/ goes on from prefill/'s cache
                    s = streams[key, i] = Stream(s.name, c.decode_model, fork(s.caches), kv=c.kv)
                s.ids = torch.tensor([[tok]])
    return out
