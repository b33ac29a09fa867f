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


ALPHA = 0.05  # a checkpoint is named when the endpoint sides with it over every other on decisive evidence
# with a one-sided sign-test p-value at most this (5 of 5 decisive votes: p = 1/32)


def votes(o: Observed, x, y) -> tuple[int, int]:
    """(votes for candidate continuation x, votes for y) from one prompt's observation: the prompt votes for
    the one whose greedy tokens the endpoint follows further where x and y differ, and, with logprobs,
    every step before either diverges from the endpoint (same context for all three) votes for the one
    whose log-probabilities over the server's top-k are closer (top-k KL), where the two differ."""
    vx = vy = 0
    if x.tokens != y.tokens:
        mx, my = matched_prefix(o.tokens, x.tokens), matched_prefix(o.tokens, y.tokens)
        vx, vy = int(mx > my), int(my > mx)
    if o.top:
        n = min(matched_prefix(o.tokens, x.tokens), matched_prefix(o.tokens, y.tokens)) + 1
        for k in range(min(n, len(o.top), len(x.logprobs), len(y.logprobs))):
            kx, ky = topk_kl(o.top[k], x.logprobs[k]), topk_kl(o.top[k], y.logprobs[k])
            if kx is None or ky is None or abs(kx - ky) <= 1e-9 * (1 + kx + ky):
                continue
            vx, vy = vx + (kx < ky), vy + (ky < kx)
    return vx, vy


def sign_p(wins: int, losses: int) -> float:
    """One-sided sign test: P(at least `wins` of wins + losses fair coin flips)."""
    n = wins + losses
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2 ** n if n else 1.0


def differs(x, y) -> int:
    """Reference-side separability of two candidates' continuations: the prompts whose greedy tokens differ."""
    return sum(a.tokens != b.tokens for a, b in zip(x, y))


def step_kl(x, y) -> tuple[float, int]:
    """(mean top-k KL(x || y), steps) over the steps both continuations reach from the same context, on the
    token ids recorded for both (the server's top-k where it returned logprobs): how far apart the two
    candidates' next-token distributions are where a logprobs vote is taken."""
    kls = []
    for a, b in zip(x, y):
        for k in range(min(matched_prefix(a.tokens, b.tokens) + 1, len(a.logprobs), len(b.logprobs))):
            kl = topk_kl(a.logprobs[k], b.logprobs[k])
            if kl is not None:
                kls.append(kl)
    return (sum(kls) / len(kls) if kls else 0.0), len(kls)


def power(conts: dict[str, list], groups: dict[str, list[str]], labels: dict[str, str], max_tokens: int,
          alpha: float = ALPHA) -> dict:
    """How far this prompt set can tell the candidate checkpoints apart, from the reference side alone (no
    endpoint needed). For each pair of checkpoints, in the numerics where they differ least (the evidence a
    server computing that way would give): the prompts whose greedy continuations differ, and the mean top-k
    KL between their next-token distributions at shared-context steps (what a server's logprobs can show);
    against the noise, the same two numbers between two numerics of one checkpoint (a correct server that
    computes a little differently moves that much). Greedy evidence is one vote per prompt, so a pair needs
    `votes_needed` differing prompts for a clean sweep to reach the sign test's `alpha`; with logprobs every
    shared step votes, and a pair separates where its KL is over twice the noise's. `tokens_for` sizes
    max_tokens (--tokens) for the greedy evidence from the per-token rate at which the pair's continuations
    part (None: more tokens cannot get there at this rate; add prompts)."""
    need = next(n for n in range(1, 64) if sign_p(n, 0) <= alpha)
    keys = list(groups)
    prompts = len(next(iter(conts.values())))

    def within(k):
        vs = groups[k]
        pairs = [(a, b) for i, a in enumerate(vs) for b in vs[i + 1:]]
        return (max([differs(conts[a], conts[b]) for a, b in pairs] or [0]),
                max([step_kl(conts[a], conts[b])[0] for a, b in pairs] or [0.0]))

    noise = {k: within(k) for k in keys}
    out = []
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            common = [(va, vb) for va in groups[a] for vb in groups[b] if va.partition("@")[2] == vb.partition("@")[2]]
            d = min((differs(conts[va], conts[vb]) for va, vb in common), default=0)
            kl, steps = min((step_kl(conts[va], conts[vb]) for va, vb in common), default=(0.0, 0))
            nd, nkl = max(noise[a][0], noise[b][0]), max(noise[a][1], noise[b][1])
            greedy_ok = d >= need and d > 2 * nd
            logprobs_ok = steps >= need and kl > 2 * nkl and kl > 0
            out.append({"a": a, "b": b, "differ": d, "noise": nd, "kl": kl, "noise_kl": nkl, "steps": steps,
                        "separable_greedy": greedy_ok, "separable_logprobs": logprobs_ok,
                        "separable": greedy_ok or logprobs_ok,
                        "tokens_for": _tokens_for(d, prompts, max_tokens, need),
                        "line": f"{labels[a]} vs {labels[b]}: greedy continuations differ on {d}/{prompts} prompts "
                                f"(numerics alone move {nd}); next-token top-k KL {kl:.2g} over {steps} steps "
                                f"(numerics alone {nkl:.2g})"})
    return {"prompts": prompts, "max_tokens": max_tokens, "votes_needed": need, "alpha": alpha, "pairs": out}


def _tokens_for(d: int, prompts: int, max_tokens: int, need: int) -> int | None:
    """max_tokens at which `need` of `prompts` continuations would part, if each token parts them at the rate
    seen (d of prompts within max_tokens): 1 - (1 - r)^T = need / prompts."""
    if need >= prompts:
        return None
    if d == 0:
        return None
    if d >= prompts:
        return max_tokens
    r = 1 - (1 - d / prompts) ** (1 / max_tokens)
    return max(1, math.ceil(math.log(1 - need / prompts) / math.log(1 - r)))


def verdict(scores: dict[str, dict], labels: dict[str, str], min_agree: float, kl_tie: float = 1e-3,
            observed: list[Observed] | None = None, conts: dict[str, list] | None = None,
            groups: dict[str, list[str]] | None = None, alpha: float = ALPHA) -> dict:
    """The checkpoint the endpoint behaves like, or "cannot tell".

    `groups`: checkpoint -> its candidate keys (one per numerics it is computed in); each checkpoint is
    represented by its best-supported variant (highest greedy agreement, then lowest top-k KL). The best
    checkpoint is named only when, against every other checkpoint whose continuations differ from its own,
    the endpoint's decisive votes (`votes`) side with it at sign-test p <= `alpha`; checkpoints whose
    continuations and log-probabilities equal its own on every prompt (byte-identical weights, or the same
    computation) cannot be told apart by any endpoint and are named as ties. Otherwise: cannot tell, with
    the checkpoints still in play. Below `min_agree` greedy agreement for all: differs from every checkpoint.
    Without `observed`/`conts` (old callers) the ranking alone decides, as before."""
    groups = groups or {k: [k] for k in scores}
    best_of = {g: min(vs, key=lambda k: (-(scores[k]["greedy_agree"] or 0), _kl(scores[k]))) for g, vs in groups.items()}
    order = sorted(best_of, key=lambda g: (-(scores[best_of[g]]["greedy_agree"] or 0), _kl(scores[best_of[g]])))
    best = order[0]
    b = scores[best_of[best]]
    if (b["greedy_agree"] or 0) < min_agree:
        return {"match": None, "ties": [], "contest": [], "line": f"differs from every checkpoint quantkit made "
                f"(best: {labels[best]}, greedy agreement {b['greedy_agree']:.2f} < {min_agree:g})"}
    if observed is None or conts is None:
        ties = [g for g in order[1:] if scores[best_of[g]]["greedy_agree"] == b["greedy_agree"]
                and (b["topk_kl"] is None or scores[best_of[g]]["topk_kl"] is None
                     or abs(_kl(scores[best_of[g]]) - _kl(b)) <= kl_tie)]
        line = f"consistent with {labels[best]}"
        if ties:
            line += " (indistinguishable on these prompts from " + ", ".join(labels[k] for k in ties) + ")"
        return {"match": best, "ties": ties, "contest": [], "line": line}
    x = conts[best_of[best]]
    ties, open_, contest = [], [], []
    for g in order[1:]:
        y = conts[best_of[g]]
        if all(a.tokens == c.tokens and a.logprobs == c.logprobs for a, c in zip(x, y)):
            ties.append(g)
            continue
        w = [votes(o, a, c) for o, a, c in zip(observed, x, y)]
        wins, losses = sum(v[0] for v in w), sum(v[1] for v in w)
        p = sign_p(wins, losses)
        apart = step_kl(x, y)[0]
        # logprob votes count only where the endpoint sits nearer the best fit than the two candidates sit to
        # each other: a server computing differently from every variant (other kernels, bf16) leaves a residual
        # KL, and within it which candidate is nearer is that noise's choice
        near = b["topk_kl"] is None or b["topk_kl"] < 0.5 * apart or not b["kl_steps"]
        greedy_wins = sum(int(matched_prefix(o.tokens, a.tokens) > matched_prefix(o.tokens, c.tokens))
                          for o, a, c in zip(observed, x, y) if a.tokens != c.tokens)
        greedy_losses = sum(int(matched_prefix(o.tokens, c.tokens) > matched_prefix(o.tokens, a.tokens))
                            for o, a, c in zip(observed, x, y) if a.tokens != c.tokens)
        ok = p <= alpha and (near or sign_p(greedy_wins, greedy_losses) <= alpha)
        contest.append({"against": g, "wins": wins, "losses": losses, "p": p, "apart_kl": apart,
                        "residual_kl": b["topk_kl"], "separated": ok})
        if not ok:
            open_.append(g)
    numerics = best_of[best].partition("@")[2]
    how = f" [{numerics} numerics]" if numerics and len(groups[best]) > 1 else ""
    if open_:
        line = (f"cannot tell: {labels[best]}{how} fits best, but the evidence does not separate it from "
                + ", ".join(labels[g] for g in open_) + f" (sign test p > {alpha:g}; see the power lines, or raise --tokens)")
        return {"match": None, "ties": ties, "contest": contest, "candidates": [best, *open_], "best_variant": best_of[best],
                "line": line}
    if ties:  # no endpoint can tell these apart: naming one would be a guess
        line = (f"cannot tell which of {labels[best]}" + "".join(f", {labels[g]}" for g in ties)
                + f" it serves: they compute the same continuations and log-probabilities on every prompt{how}; "
                "it is one of them (they separate from every other checkpoint at sign test p <= " + f"{alpha:g})")
        return {"match": None, "ties": ties, "contest": contest, "candidates": [best, *ties], "best_variant": best_of[best],
                "line": line}
    return {"match": best, "ties": [], "contest": contest, "candidates": [best], "best_variant": best_of[best],
            "line": f"consistent with {labels[best]}{how}"}


def _kl(s: dict) -> float:
    return s["topk_kl"] if s["topk_kl"] is not None else math.inf
