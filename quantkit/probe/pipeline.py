"""`quantkit probe`: check the pair and the endpoint first (cheap, and the usual failures), then the
reference forward (the long part), then compare, report and, with `write_card`, record the verdict
in the pair's model cards."""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import ConfigError
from quantkit.model.arch import arch_from_config
from quantkit.probe.client import Endpoint, ProbeError, Reply
from quantkit.probe.compare import Observed, score, verdict
from quantkit.probe.prompts import PromptSet, load_tokenizer, read_prompt_set, tokenize_prompt_set
from quantkit.probe.tools import check_tool_replies, tool_lines
from quantkit.validation.card import PROBES_HEADING as CARD_HEADING
from quantkit.validation.toolcalls import read_tool_task


@dataclass
class ProbeResult:
    data: dict

    def lines(self) -> list[str]:
        d = self.data
        out = [f"endpoint {d['endpoint']} (model {d['model']}), prompt set {d['prompt_set']['name']} "
               f"({d['prompt_set']['prompts']} prompts, max_tokens {d['prompt_set']['max_tokens']}); "
               f"logprobs {'returned' if d['logprobs'] else 'not returned (greedy agreement only)'}; "
               f"candidates in {(d.get('numerics') or {}).get('mode', 'weights')} numerics",
               f"{'checkpoint':<62} {'greedy agree':>12} {'exact':>7} {'top-k KL':>10}"]
        for k, s in d["candidates"].items():
            kl = "—" if s["topk_kl"] is None else f"{s['topk_kl']:.4f}"
            out.append(f"{s['label']:<62} {s['greedy_agree']:>12.3f} {s['prompts_exact']:>3}/{s['prompts']:<3} {kl:>10}")
        out += [f"warning: {w}" for w in d["warnings"]]
        pw = d.get("power")
        if pw:
            out.append(f"power ({pw['prompts']} prompts x {pw['max_tokens']} tokens; {pw['votes_needed']} decisive votes "
                       f"name one at p <= {pw['alpha']:g}: one per prompt from greedy tokens, one per step from logprobs):")
            for x in pw["pairs"]:
                ok = x["separable_logprobs"] if d["logprobs"] else x["separable_greedy"]
                more = "" if ok else "  <- not separable" + (
                    "" if d["logprobs"] else f"; --tokens {x['tokens_for']} would part {pw['votes_needed']} prompts at this rate"
                    if x["tokens_for"] else "; more prompts (or a server returning logprobs) needed")
                out.append(f"  {x['line']}{more}")
        out.append(f"verdict: {d['verdict']['line']}")
        return out + tool_lines(d.get("tool_calls"))


def probe(url: str, pair: str | Path, *, model: str | None = None, api_key_env: str = "OPENAI_API_KEY",
          timeout: float = 60.0, retries: int = 4, concurrency: int = 4, kv_cache_dtype: str = "auto",
          min_agree: float = 0.9, device: str = "auto", write_card: bool = False, logprobs: bool = True,
          prompts: str | Path | None = None, numerics: str = "auto", tool_task: str | Path | None = None,
          tokens: int | None = None) -> ProbeResult:
    """Probe `url` (an OpenAI-compatible server) with the recorded prompts and name the checkpoint of
    `pair` (a `quantkit convert` output, or one checkpoint folder) that it behaves most like.
    `prompts`: another recorded prompt set (default: the shipped quantkit/probe/prompts.json).
    `numerics`: how the candidates are computed (quantkit.model.numerics): `auto` (the default) computes each
    candidate in every numerics that computes it differently: `engine` (vLLM and SGLang, and transformers on a
    GPU or for compressed-tensors checkpoints: FP8 block Linears W8A8), `transformers` (transformers on a CPU:
    a native FP8 checkpoint dequantized on load with the block it infers from the scale grid) and `weights`
    (a server running dequantized copies); each checkpoint is then judged by its best-supported variant.
    One of those names computes the candidates that way only.
    `tokens`: greedy tokens per prompt (default: the prompt set's max_tokens); the result's `power` says
    how far the prompt set separates the checkpoints at that budget and what would (compare.power).
    `tool_task`: also send a tool task's prompts (`default`: quantkit/validation/tooltask.json) with `tools=`
    to the chat API and score the answers against the source's, computed here (quantkit.validation.toolcalls):
    finish_reason tool_calls F1 and the schema accuracy of the endpoint's calls, in `data["tool_calls"]`."""
    from quantkit.model.numerics import PROBE_NUMERICS, numerics_record
    from quantkit.validation.targets import target

    if numerics not in ("auto", *PROBE_NUMERICS):
        raise ProbeError(f"--numerics {numerics}: one of auto, {', '.join(PROBE_NUMERICS)}")
    if tokens is not None and tokens < 1:
        raise ProbeError(f"--tokens {tokens}: at least 1 greedy token per prompt")

    t = target(pair, None)
    tok_dir = t.models.get("decode") or t.reference_path
    prompt_file = read_prompt_set(Path(prompts) if prompts else None)
    tools = read_tool_task(tool_task)  # a bad tool task fails before the endpoint is asked
    ep = Endpoint(url, model, api_key_env, timeout, retries, concurrency=concurrency, logprobs=logprobs)
    try:
        ep.model = _served_model(ep, model)  # the usual failures (no server, wrong URL or model) before any tokenizer
        tok = load_tokenizer(Path(tok_dir))
        ps = tokenize_prompt_set(prompt_file, tok)
        if tokens is not None:
            ps.max_tokens = tokens
        replies = ep.complete_all(ps.prompts, ps.max_tokens, ps.top_logprobs)
        tool_replies = [ep.chat_tools(p, tools.max_tokens) for p in tools.prompts] if tools else None
    finally:
        ep.close()
    observed = [_observe(r, tok) for r in replies]
    warnings = [f"prompt {p.id}: the server counted {r.prompt_tokens} prompt tokens, the pair's tokenizer "
                f"{len(p.ids)}: the endpoint tokenizes differently (another tokenizer or chat template)"
                for p, r in zip(ps.prompts, replies) if r.prompt_tokens is not None and r.prompt_tokens != len(p.ids)]
    if tools:
        syntax = arch_from_config(json.loads((Path(tok_dir) / "config.json").read_text())).definition.tool_calls
        tool_ids = check_tool_replies(ep.url, tools, tool_replies, tok, syntax)  # before the long part, too
    data = _compare(t, ps, observed, tok_dir, kv_cache_dtype, min_agree, device, numerics)
    if tools:
        data["tool_calls"] = _tool_calls(t, tools, tool_ids, tool_replies, tok, tok_dir, syntax,
                                         "engine" if numerics == "auto" else numerics, device)
    data["numerics"] = ({"mode": "auto", "line": "candidates in every numerics that computes them differently: "
                         + "; ".join(numerics_record(n)["line"] for n in PROBE_NUMERICS)}
                        if numerics == "auto" else numerics_record(numerics))
    data.update(endpoint=ep.url, model=ep.model, date=_dt.date.today().isoformat(), warnings=warnings + data["warnings"],
                logprobs=any(o.top for o in observed),
                replies=[{"id": p.id, "text": r.text, "finish_reason": r.finish_reason, "tokens": o.tokens}
                         for p, r, o in zip(ps.prompts, replies, observed)])
    result = ProbeResult(data)
    if write_card:
        data["cards"] = [str(p) for p in write_cards(t, data)]
    return result


def _served_model(ep: Endpoint, model: str | None) -> str:
    """The model to ask for: --model (checked against GET /models where the server lists any), else the
    server's only model."""
    try:
        served = ep.models(retries=1 if model is not None else None)
    except ProbeError as e:
        # a server that answers but cannot list (transformers serve without a Hub cache: 500) may still
        # serve --model; the first prompt tells. No answer at all is fatal here.
        if model is None or e.status is None or e.status in (401, 403):
            raise
        served = []
    if model is not None:
        if served and model not in served:
            raise ProbeError(f"{ep.url}: the server does not serve model {model!r} (GET /models lists: "
                             f"{', '.join(map(str, served))}); pass one of those with --model")
        return model
    if len(served) == 1:
        return served[0]
    raise ProbeError(f"{ep.url}: the server lists {len(served)} models ({', '.join(map(str, served)) or 'none'}); "
                     "name the one to probe with --model")


def _compare(t, ps: PromptSet, observed: list[Observed], tok_dir, kv_cache_dtype, min_agree, device, numerics) -> dict:
    """The reference continuations of every candidate (in each numerics that computes it differently, under
    `auto`), each scored against what the endpoint produced; the power of the prompt set and the verdict
    (torch and the reference forward are imported here, after the endpoint has answered)."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.inputs.modelspec import open_checkpoint
    from quantkit.probe.compare import power
    from quantkit.probe.reference import candidates, greedy, keep_resident, variants
    from quantkit.runtime.device import resolve_device

    single = "model" in t.models  # one checkpoint folder: it is the only candidate, as "source"

    def reopen(m: str) -> Checkpoint:
        if single:
            return Checkpoint(t.models["model"])
        return open_checkpoint(t.reference_source) if m == "reference" else Checkpoint(t.models[m])

    ckpts = {m: reopen(m) for m in (["reference"] if single else ["reference", *t.models])}
    arch = ckpts["reference"].arch
    modes = ("engine", "transformers", "weights") if numerics == "auto" else (numerics,)
    cands, ckpts, groups = variants(candidates(t.pair, arch.has_dsa, kv_cache_dtype), ckpts, modes, reopen)
    glabels = {c.key.partition("@")[0]: c.label for c in cands}
    labels = {c.key: c.label + (f" [{c.key.partition('@')[2]} numerics]" if "@" in c.key else "") for c in cands}
    wanted = [[set(o.top[k]) | ({o.tokens[k]} if k < len(o.tokens) else set()) for k in range(len(o.top))] if o.top
              else [{x} for x in o.tokens] for o in observed]
    dev = resolve_device(device)
    chunk = keep_resident(ckpts, dev)
    conts = greedy(ckpts, cands, [p.ids for p in ps.prompts], ps.max_tokens, wanted, _eos(Path(tok_dir)), dev, chunk=chunk)
    scores = {c.key: dict(label=labels[c.key], **score(observed, conts[c.key])) for c in cands}
    for c in cands:
        scores[c.key]["reference_tokens"] = [x.tokens for x in conts[c.key]]
    return {"pair": str(t.out), "warnings": _dsa_warnings(arch, ps), "prompt_set": {"name": ps.name, "sha256": ps.sha256, "prompts": len(ps.prompts),
                                               "max_tokens": ps.max_tokens, "top_logprobs": ps.top_logprobs},
            "candidates": scores, "groups": groups,
            "power": power(conts, groups, glabels, ps.max_tokens),
            "verdict": verdict(scores, glabels, min_agree, observed=observed, conts=conts, groups=groups)}


def _tool_calls(t, tools, ids: list[list[int]], replies, tok, tok_dir, syntax: str, numerics: str, device) -> dict:
    """The source's answers to the tool prompts through quantkit's forward (the reference, as
    K2-Vendor-Verifier takes the official API), and the endpoint's scored against them."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.inputs.modelspec import open_checkpoint
    from quantkit.runtime.device import resolve_device
    from quantkit.validation.toolcalls import Call, Generation, as_generation, eos_ids, generate, result

    ref = Checkpoint(t.models["model"]) if "model" in t.models else open_checkpoint(t.reference_source)
    ref.numerics = numerics
    raw = generate({"reference": ref}, {"reference": ("reference", None)}, ids, tools.max_tokens, eos_ids(Path(tok_dir), tok),
                   resolve_device(device))
    gens = {"reference": [as_generation(x, stopped, tok, syntax) for x, stopped in raw["reference"]],
            "endpoint": [Generation(r.finish_reason, [Call(n, a) for n, a in r.calls], r.text) for r in replies]}
    ref.close()
    return result(tools, syntax, numerics, gens)


def _dsa_warnings(arch, ps: PromptSet) -> list[str]:
    """Past `index_topk` tokens a DSA model attends to the indexer's top-k only, and the indexer's exact
    ties (ReLU zeros) are broken however each implementation's top-k breaks them (quantkit: earliest
    first; torch.topk: unspecified): tokens generated there can differ between two correct engines."""
    if not arch.has_dsa:
        return []
    long = [p.id for p in ps.prompts if len(p.ids) + ps.max_tokens > arch.index_topk]
    return [f"prompts {', '.join(long)}: prompt + max_tokens exceed the DSA index_topk ({arch.index_topk}); "
            "from there the sparse selection's ties are implementation-defined, so disagreement past that point "
            "is weaker evidence"] if long else []


# ---- tokens ------------------------------------------------------------------------------------------
def _observe(r: Reply, tok) -> Observed:
    """The reply in the pair's token ids: the logprobs' tokens where the server returned them (vLLM's
    `token_id:N` form, or decoded strings), else the text tokenized by the pair's tokenizer."""
    if r.tokens:
        lookup = _lookup(tok)
        return Observed([lookup(s) for s in r.tokens], [{lookup(s): v for s, v in d.items()} for d in r.top or []] or None)
    return Observed(tok.encode(r.text, add_special_tokens=False), None)


def _lookup(tok):
    decoded: dict[str, int] = {}
    vocab = tok.get_vocab()

    def find(s: str) -> int:
        if s.startswith("token_id:") and s[9:].isdigit():
            return int(s[9:])
        if s in vocab:
            return vocab[s]
        if not decoded:
            for i in range(len(tok)):
                decoded.setdefault(tok.decode([i]), i)
        return decoded.get(s, decoded.get(s.strip(), -1))

    return find


def _eos(folder: Path) -> set[int]:
    ids: set[int] = set()
    gen = folder / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(e) if isinstance(e, list) else ({e} if isinstance(e, int) else set())
    return ids


# ---- the cards ---------------------------------------------------------------------------------------
def write_cards(t, data: dict) -> list[Path]:
    """Add (or replace, for the same endpoint and model) one line under "Endpoint probes" in each card."""
    if not t.pair:
        raise ConfigError(f"{t.out}: --write-card needs a `quantkit convert` output (prefill/ and decode/ with cards)")
    best = data["verdict"]
    s = data["candidates"].get(best.get("best_variant") or best["match"] or "", {}) if best["match"] else {}
    detail = (f"greedy agreement {s['greedy_agree']:.2f}" + (f", top-k KL {s['topk_kl']:.3g}" if s.get("topk_kl") is not None else "")
              if s else "")
    key = f"endpoint {data['endpoint']} (model {data['model']})"
    numerics = f"; candidates in {data['numerics']['mode']} numerics" if data.get("numerics") else ""
    line = (f"- {key} probed on {data['date']}: {best['line']}" + (f" ({detail}" if detail else "")
            + (f"; prompt set {data['prompt_set']['name']}, sha256 {data['prompt_set']['sha256'][:12]}{numerics})" if detail else
               f" (prompt set {data['prompt_set']['name']}, sha256 {data['prompt_set']['sha256'][:12]}{numerics})"))
    paths = []
    for which in ("prefill", "decode"):
        path = t.models[which] / "README.md"
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        lines = [x for x in text.rstrip("\n").split("\n") if not x.startswith(f"- {key} probed on")] if text else []
        if CARD_HEADING not in lines:
            lines += ["", CARD_HEADING, "",
                      "`quantkit probe` against live endpoints (greedy on a fixed prompt set; docs/serving.md):", ""]
        at = len(lines)
        for i in range(lines.index(CARD_HEADING) + 1, len(lines)):
            if lines[i].startswith("## "):
                at = i
                break
        lines.insert(at if at == len(lines) else at - 1, line)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths
