"""The endpoint against each candidate: greedy agreement up to the first divergence (after it the two
continue from different contexts, so nothing later is comparable), KL over the top-k the server
returned at those same-context steps, and the verdict naming the candidate it behaves most like."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Observed:
    """What the endpoint produced for one prompt, in the pair's token ids."""

    tokens: list[int]
    top: list[dict[int, float]] | None  # per step: {token id: server logprob}, when returned


def matched_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def topk_kl(server: dict[int, float], ref: dict[int, float]) -> float | None:
    """KL(server || reference) over the server's top-k ids, both renormalized over them: the part of the
    two distributions the server reveals (0 when the reference ranks them in the same proportions)."""
    ids = [t for t in server if t in ref]
    if len(ids) < 2:
        return None
    ps = _normalize([server[t] for t in ids])
    qs = _normalize([ref[t] for t in ids])
    return max(0.0, sum(p * (math.log(p) - math.log(q)) for p, q in zip(ps, qs) if p > 0))


def _normalize(logps: list[float]) -> list[float]:
    m = max(logps)
    e = [math.exp(x - m) for x in logps]
    s = sum(e)
    return [max(x / s, 1e-30) for x in e]


def score(observed: list[Observed], conts) -> dict:
    """One candidate's numbers over all prompts: tokens agreeing before the first divergence (of the
    tokens compared: the longer of the two continuations), prompts fully equal, the mean top-k KL."""
    agree = total = exact = 0
    kls: list[float] = []
    first = []
    for o, c in zip(observed, conts):
        n = matched_prefix(o.tokens, c.tokens)
        same = n == len(o.tokens) == len(c.tokens)
        agree += n
        total += max(len(o.tokens), len(c.tokens), 1)
        exact += same
        first.append(None if same else n)
        if o.top:
            for k in range(min(n + 1, len(o.top), len(c.logprobs))):  # steps n and before share the context
                kl = topk_kl(o.top[k], c.logprobs[k])
                if kl is not None:
                    kls.append(kl)
    return {"greedy_agree": agree / total if total else None, "prompts_exact": exact, "prompts": len(observed),
            "first_divergence": first, "topk_kl": sum(kls) / len(kls) if kls else None, "kl_steps": len(kls)}


def verdict(scores: dict[str, dict], labels: dict[str, str], min_agree: float, kl_tie: float = 1e-3) -> dict:
    """The candidate the endpoint behaves most like: highest greedy agreement, then lowest top-k KL.
    Below `min_agree` for all of them: it differs from every checkpoint. Candidates the numbers cannot
    tell apart (same agreement, KL within `kl_tie` or not measured) are named as ties."""
    order = sorted(scores, key=lambda k: (-(scores[k]["greedy_agree"] or 0), _kl(scores[k])))
    best = order[0]
    b = scores[best]
    if (b["greedy_agree"] or 0) < min_agree:
        return {"match": None, "ties": [], "line": f"differs from every checkpoint quantkit made (best: {labels[best]}, "
                f"greedy agreement {b['greedy_agree']:.2f} < {min_agree:g})"}
    ties = [k for k in order[1:] if scores[k]["greedy_agree"] == b["greedy_agree"]
            and (b["topk_kl"] is None or scores[k]["topk_kl"] is None or abs(_kl(scores[k]) - _kl(b)) <= kl_tie)]
    line = f"consistent with {labels[best]}"
    if ties:
        line += " (indistinguishable on these prompts from " + ", ".join(labels[k] for k in ties) + ")"
    return {"match": best, "ties": ties, "line": line}


def _kl(s: dict) -> float:
    return s["topk_kl"] if s["topk_kl"] is not None else math.inf
