"""Tool calls: does a checkpoint still call the tools its source calls, with arguments that fit the schemas?

Agentic use compounds small per-step errors over many tool calls, and KL or task accuracy does not
show whether a quantized model still decides to call a tool where its source does, or still writes
arguments a tool accepts. Moonshot's K2-Vendor-Verifier measures exactly that between providers;
here the same two numbers compare each checkpoint with its source (the source is the reference):

    tool-call F1    per prompt, did the answer end with finish_reason "tool_calls"? Against the
                    source's decision: TP both call, FP only this one, FN only the source;
                    F1 = 2 TP / (2 TP + FP + FN) (None when neither ever calls: nothing to agree on)
    schema accuracy of the tool calls emitted, the fraction whose name is one of the prompt's tools
                    and whose arguments parse as a JSON object that validates against that tool's
                    JSON schema (jsonschema); None when none were emitted

plus the paired difference in the call rate (this minus source, per prompt, with its SE) and the
per-prompt record. The task is a local file of chat prompts with OpenAI-style tool schemas
(`tools`: [{"type": "function", "function": {"name", "description", "parameters"}}]); the shipped
one is quantkit/validation/tooltask.json. Each prompt is rendered by the model's own chat template
with its tools (`apply_chat_template(messages, tools=...)`), generated greedily through quantkit's
streaming forward, and the emitted text parsed with the family's tool-call syntax (the family
definition's `tool_calls`: SYNTAXES below, as the engines' tool parsers read it). The probe sends the
same prompts to an endpoint's chat API with `tools=` and scores its answers the same way.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from quantkit.errors import ConfigError

__all__ = ["Call", "Generation", "ToolTask", "SYNTAXES", "read_tool_task", "parse_calls", "schema_problem", "compare",
           "generate", "run_tool_task", "tool_markdown", "tool_card", "tool_caption"]

DEFAULT = "default"  # --tool-task default: the shipped quantkit/validation/tooltask.json
ROWS = {"reference": "source", "prefill": "prefill (FP8)", "decode": "decode (INT4)", "model": "model",
        "decode_kv": "decode (INT4) + FP8 KV cache", "endpoint": "endpoint"}


# ---- the task ----------------------------------------------------------------------------------------
@dataclass
class ToolPrompt:
    id: str
    messages: list[dict]
    tools: list[dict]


@dataclass
class ToolTask:
    name: str
    where: str
    sha256: str
    max_tokens: int
    prompts: list[ToolPrompt]

    def record(self) -> dict:
        return {"name": self.name, "path": self.where, "sha256": self.sha256, "prompts": len(self.prompts),
                "max_tokens": self.max_tokens}


def read_tool_task(path: str | Path | None) -> ToolTask | None:
    """The tool task at `path` (`default`: the shipped one; None: no tool check), checked before anything
    runs: a JSON object with a `prompts` list, or JSONL with one prompt (a chat request body) per line;
    every prompt needs `messages` and a non-empty `tools` list of function schemas."""
    if path is None:
        return None
    if str(path) == DEFAULT:
        raw, where = resources.files("quantkit.validation").joinpath("tooltask.json").read_bytes(), "quantkit/validation/tooltask.json"
    else:
        if not Path(path).is_file():
            raise ConfigError(f"--tool-task {path}: no such file; pass a JSON/JSONL tool task like quantkit/validation/tooltask.json "
                              "(or `default` for that one)")
        raw, where = Path(path).read_bytes(), str(path)
    try:
        if where.endswith(".jsonl"):
            d = {"prompts": [json.loads(line) for line in raw.decode().splitlines() if line.strip()]}
        else:
            d = json.loads(raw)
        items = d["prompts"]
        assert isinstance(items, list) and items
    except (json.JSONDecodeError, KeyError, TypeError, AssertionError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}: not a tool task ({type(e).__name__}); it needs a non-empty `prompts` list "
                          "(or one chat request per line in a .jsonl)") from None
    prompts = [_prompt(where, i, p) for i, p in enumerate(items)]
    return ToolTask(str(d.get("name", Path(where).stem)), where, hashlib.sha256(raw).hexdigest(), int(d.get("max_tokens", 32)),
                    prompts)


def _prompt(where: str, i: int, p) -> ToolPrompt:
    pid = str(p.get("id", i)) if isinstance(p, dict) else str(i)
    if not isinstance(p, dict) or not isinstance(p.get("messages"), list) or not p["messages"]:
        raise ConfigError(f"{where}: prompt {pid!r} has no `messages` list; each prompt is a chat request (messages, tools)")
    tools = p.get("tools")
    fix = ("`tools`: a list of {\"type\": \"function\", \"function\": {\"name\", \"parameters\": a JSON schema}}; "
           "a tool task is prompts with the tools they may call")
    if not isinstance(tools, list) or not tools:
        raise ConfigError(f"{where}: prompt {pid!r} has no tool schemas ({fix})")
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("parameters"), dict):
            name = fn.get("name") if isinstance(fn, dict) else None
            raise ConfigError(f"{where}: prompt {pid!r}, tool {name!r} has no schema ({fix})")
    return ToolPrompt(pid, p["messages"], tools)


# ---- the model's text -> tool calls ---------------------------------------------------------------------
@dataclass
class Call:
    name: str
    arguments: str  # as emitted: a JSON object's text when the model wrote it right


@dataclass
class Generation:
    """One answer: OpenAI's finish_reason ("tool_calls", "stop", "length"), the calls, the text."""

    finish_reason: str | None
    calls: list[Call] = field(default_factory=list)
    text: str = ""


def _hermes(text: str) -> list[Call]:
    """Hermes (the syntax of many open families): <tool_call>{"name": ..., "arguments": {...}}</tool_call> (vLLM's hermes parser)."""
    out = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S):
        try:
            d = json.loads(body)
            out.append(Call(str(d["name"]), json.dumps(d.get("arguments", {})) if not isinstance(d.get("arguments"), str)
                            else d["arguments"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            m = re.search(r'"name"\s*:\s*"([^"]*)"', body)
            out.append(Call(m.group(1) if m else "", body.strip()))  # a call was started; its arguments do not parse
    return out


def _kimi(text: str) -> list[Call]:
    """Kimi K2: <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>."""
    pat = r"<\|tool_call_begin\|>\s*(?:functions\.)?([^<:\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*?)(?:<\|tool_call_end\|>|$)"
    return [Call(n, a.strip()) for n, a in re.findall(pat, text, re.S)]


def _glm(text: str) -> list[Call]:
    """GLM-4.5 and later: <tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>;
    a value is JSON where it parses, else a string (as vLLM's glm45 parser reads it)."""
    out = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text, re.S):
        name = body.split("<arg_key>", 1)[0].strip()
        args = {}
        for k, v in re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", body, re.S):
            try:
                args[k.strip()] = json.loads(v)
            except json.JSONDecodeError:
                args[k.strip()] = v
        out.append(Call(name, json.dumps(args)))
    return out


def _deepseek(text: str) -> list[Call]:
    """DeepSeek-V3: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json {...} ```<｜tool▁call▁end｜>."""
    pat = r"<｜tool▁call▁begin｜>\s*\w*\s*<｜tool▁sep｜>\s*([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```"
    return [Call(n, a) for n, a in re.findall(pat, text, re.S)]


SYNTAXES = {"hermes": _hermes, "kimi_sections": _kimi, "glm45": _glm, "deepseek_fences": _deepseek}


def parse_calls(text: str, syntax: str) -> list[Call]:
    """The tool calls in a model's text, in the family's syntax."""
    return SYNTAXES[syntax](text)


def schema_problem(call: Call, tools: list[dict]) -> str | None:
    """Why `call` does not fit the prompt's tools (None: it does): an unknown name, arguments that are not
    a JSON object, or arguments the tool's JSON schema rejects."""
    try:
        import jsonschema
    except ImportError:
        raise ConfigError("the tool-call check needs jsonschema, which is not installed: pip install 'jsonschema>=4'") from None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if call.name not in schemas:
        return f"no tool named {call.name!r}"
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError as e:
        return f"arguments are not JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"arguments are a JSON {type(args).__name__}, not an object"
    err = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schemas[call.name])(schemas[call.name]).iter_errors(args))
    return None if err is None else f"schema: {err.message}"


# ---- the metrics --------------------------------------------------------------------------------------
def schema_counts(gens: list[Generation], task: ToolTask) -> dict:
    """Schema accuracy of the calls in `gens` (one per prompt), with the counts."""
    calls = valid = 0
    for g, p in zip(gens, task.prompts):
        for c in g.calls:
            calls += 1
            valid += schema_problem(c, p.tools) is None
    return {"calls": calls, "schema_valid": valid, "schema_accuracy": valid / calls if calls else None}


def f1(ref: list[Generation], other: list[Generation]) -> float | None:
    """finish_reason tool_calls F1 of `other` against `ref` (None when neither ever calls)."""
    tc = [(r.finish_reason == "tool_calls", o.finish_reason == "tool_calls") for r, o in zip(ref, other)]
    tp, wrong = sum(a and b for a, b in tc), sum(a != b for a, b in tc)
    return 2 * tp / (2 * tp + wrong) if tp + wrong else None


def schema_accuracy(gens: list[Generation], task: ToolTask) -> float | None:
    return schema_counts(gens, task)["schema_accuracy"]


def jackknife(stat, n: int) -> float | None:
    """The jackknife standard error of `stat(kept)` over n prompts (kept: the indices left in): the SE of
    a ratio over prompts (F1, schema accuracy) or of a difference of two on the same prompts (paired).
    None when some leave-one-out value is undefined or n < 2."""
    if n < 2:
        return None
    values = [stat([j for j in range(n) if j != i]) for i in range(n)]
    if any(v is None for v in values):
        return None
    mean = sum(values) / n
    return math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in values))


def paired_f1(ref: list[Generation], a: list[Generation], b: list[Generation]) -> tuple[float | None, float | None]:
    """F1(a) - F1(b), both against `ref` on the same prompts, and its jackknife SE (paired over prompts):
    how two checkpoints' tool-call decisions compare (a damaged decode/ against an intact one)."""
    def diff(kept):
        fa, fb = f1([ref[i] for i in kept], [a[i] for i in kept]), f1([ref[i] for i in kept], [b[i] for i in kept])
        return None if fa is None or fb is None else fa - fb

    return diff(range(len(ref))), jackknife(diff, len(ref))


def compare(ref: list[Generation], other: list[Generation], task: ToolTask) -> dict:
    """One row against the reference: finish_reason tool_calls F1 with TP/FP/FN/TN and its SE, schema accuracy
    with the paired difference from the reference's (this minus reference), the paired call-rate difference
    (SEs over prompts: jackknife for the ratios) and every prompt's record."""
    from quantkit.validation.tasks import paired

    tc = [(r.finish_reason == "tool_calls", o.finish_reason == "tool_calls") for r, o in zip(ref, other)]
    tp, fp = sum(a and b for a, b in tc), sum(b and not a for a, b in tc)
    fn, tn = sum(a and not b for a, b in tc), sum(not a and not b for a, b in tc)
    rate = paired({i: float(a) for i, (a, _) in enumerate(tc)}, {i: float(b) for i, (_, b) in enumerate(tc)})
    n = len(tc)

    def schema_delta(kept):
        sub = ToolTask(task.name, task.where, task.sha256, task.max_tokens, [task.prompts[i] for i in kept])
        this, source = schema_accuracy([other[i] for i in kept], sub), schema_accuracy([ref[i] for i in kept], sub)
        return None if this is None or source is None else this - source

    schema = schema_counts(other, task)
    return {"prompts": n, "tool_calls": tp + fp, "reference_tool_calls": tp + fn, "tp": tp, "fp": fp, "fn": fn, "tn": tn,
            "precision": tp / (tp + fp) if tp + fp else None, "recall": tp / (tp + fn) if tp + fn else None,
            "f1": f1(ref, other), "f1_stderr": jackknife(lambda kept: f1([ref[i] for i in kept], [other[i] for i in kept]), n),
            **schema, "schema_accuracy_delta": schema_delta(range(n)), "schema_accuracy_delta_stderr": jackknife(schema_delta, n),
            "call_rate_delta": rate["delta"], "call_rate_delta_stderr": rate["delta_stderr"],
            "per_prompt": [_record(p, r, o) for p, r, o in zip(task.prompts, ref, other)]}


def _record(p: ToolPrompt, r: Generation, o: Generation) -> dict:
    return {"id": p.id, "reference": r.finish_reason, "this": o.finish_reason, "reference_calls": [c.name for c in r.calls],
            "calls": [{"name": c.name, "arguments": c.arguments[:500], "problem": schema_problem(c, p.tools)} for c in o.calls],
            "text": o.text[:500]}


# ---- generation through quantkit's forward ----------------------------------------------------------------
def render(task: ToolTask, tok, tools: bool = True) -> list[list[int]]:
    """Each prompt's token ids under the model's chat template, with its tools (the generation prompt added)."""
    out = []
    for p in task.prompts:
        enc = tok.apply_chat_template(p.messages, tools=p.tools if tools else None, add_generation_prompt=True, tokenize=True)
        out.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
    return out


def generate(ckpts: dict, runs: dict, prompts: list[list[int]], max_tokens: int, eos: set[int], device, dtype=None,
             chunk: int = 16, bar=None) -> dict[str, list[tuple[list[int], bool]]]:
    """{row: [(greedy tokens, stopped on EOS) per prompt]} for `runs` {row: (checkpoint key, KVCache or None)}: every
    row and prompt its own stream with caches, all advanced in lockstep (each layer loaded once per step).
    `bar` (quantkit.runtime.progress.LayerProgress over max_tokens), when given, counts the steps."""
    import torch

    from quantkit.validation.forward import Stream, heads, new_caches, step

    dtype = dtype or torch.float32
    streams = {(row, i): Stream(f"{row}#{i}", key, new_caches(ckpts[key]), ids=torch.tensor([ids]), kv=kv)
               for row, (key, kv) in runs.items() for i, ids in enumerate(prompts)}
    out = {row: [([], False) for _ in prompts] for row in runs}
    for n in range(max_tokens):
        live = {k: s for k, s in streams.items() if not out[k[0]][k[1]][1]}
        if not live:
            break
        step(ckpts, list(live.values()), device, dtype, chunk=chunk)
        if bar is not None:
            bar.update(n + 1)
        for (row, i), s in live.items():
            tok = int(heads(ckpts[s.model], [s.h[:, -1:]], dtype)[0][0, -1].argmax())
            if tok in eos:
                out[row][i] = (out[row][i][0], True)
                continue
            out[row][i][0].append(tok)
            s.ids = torch.tensor([[tok]])
    return out


def as_generation(tokens: list[int], stopped: bool, tok, syntax: str) -> Generation:
    """A greedy continuation as an OpenAI answer would report it: the calls parsed from its text (special
    tokens kept: the tool-call markers are special tokens), finish_reason tool_calls when there are any."""
    text = tok.decode(tokens, skip_special_tokens=False)
    calls = parse_calls(text, syntax)
    return Generation("tool_calls" if calls else ("stop" if stopped else "length"), calls, text)


def run_tool_task(task: ToolTask, ckpts: dict, tokenizer: Path, kv: dict, dev, dtype, chunk: int,
                  progress: bool = False) -> dict:
    """validation.json's `tool_calls`: the task on the source and every checkpoint row (and decode with the
    FP8 KV cache when validate simulates one), each row against the source. `progress`: a line per
    sixteenth of the greedy steps in a log (a bar in a terminal): the task runs for minutes."""
    from quantkit.inputs.tokens import open_tokenizer
    from quantkit.runtime.progress import LayerProgress

    definition = ckpts["reference"].arch.definition
    tok, syntax = open_tokenizer(tokenizer, definition.trust_remote_code), definition.tool_calls
    runs = {row: (row, None) for row in ckpts}
    if "" in kv and "decode" in ckpts:
        runs["decode_kv"] = ("decode", kv[""])
    prompts = render(task, tok)
    with LayerProgress(progress, task.max_tokens, f"validate: tool task ({len(prompts)} prompts x {len(runs)} rows)",
                       per_line=max(1, task.max_tokens // 16), unit="validate: tool task, greedy step") as bar:
        bar.update(0)
        raw = generate(ckpts, runs, prompts, task.max_tokens, eos_ids(Path(tokenizer), tok), dev, dtype, chunk, bar)
    gens = {row: [as_generation(t, stopped, tok, syntax) for t, stopped in raw[row]] for row in runs}
    return result(task, syntax, ckpts["reference"].numerics, gens)


def result(task: ToolTask, syntax: str, numerics: str, gens: dict[str, list[Generation]]) -> dict:
    """The `tool_calls` record: every row of `gens` (the first is the reference) against the reference."""
    ref = next(iter(gens))
    rows = {row: compare(gens[ref], g, task) for row, g in gens.items()}
    return {"task": task.record(), "syntax": syntax, "numerics": numerics, "reference_row": ref, "rows": rows, "note": note(rows)}


def note(rows: dict) -> str:
    """What the rows can show: with no tool call anywhere the F1 is undefined (only the counts say the
    prompts ran), which is what a model that never learned the syntax (the tiny models) gives."""
    calling = [ROWS.get(r, r) for r, x in rows.items() if x["tool_calls"]]
    if not calling:
        return ("no row ended a prompt with a tool call (finish_reason tool_calls), so F1 and schema accuracy are "
                "undefined (—): the model never wrote the family's tool-call syntax on these prompts")
    return f"rows with tool calls: {', '.join(calling)}"


def eos_ids(folder: Path, tok) -> set[int]:
    """End-of-sequence ids: generation_config.json's (one or a list) and the tokenizer's."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = folder / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(e) if isinstance(e, list) else ({e} if isinstance(e, int) else set())
    return ids


def rows_markdown(t: dict) -> list[str]:
    """The table of validation.json's (or the probe's) `tool_calls` rows."""
    lines = ["| row | prompts | finish_reason tool_calls (this / source) | TP | FP | FN | TN | tool-call F1 ± SE | calls "
             "| schema-valid | schema accuracy | schema accuracy Δ ± SE (paired) | call rate Δ ± SE (paired) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, r in t["rows"].items():
        ref = row == t.get("reference_row", "reference")
        delta = "—" if ref or r.get("call_rate_delta") is None else (
            f"{r['call_rate_delta']:+.3f} ± {_g(r.get('call_rate_delta_stderr'), '.3f')}")
        schema = "—" if ref or r.get("schema_accuracy_delta") is None else (
            f"{r['schema_accuracy_delta']:+.3f} ± {_g(r.get('schema_accuracy_delta_stderr'), '.3f')}")
        f1 = _g(r["f1"], ".3f") + ("" if r.get("f1_stderr") is None else f" ± {r['f1_stderr']:.3f}")
        lines.append(f"| {ROWS.get(row, row)} | {r['prompts']} | {r['tool_calls']} / {r['reference_tool_calls']} "
                     + ("| — | — | — | — | — " if ref else f"| {r['tp']} | {r['fp']} | {r['fn']} | {r['tn']} | {f1} ")
                     + f"| {r['calls']} | {r['schema_valid']} | {_g(r['schema_accuracy'], '.3f')} | {schema} | {delta} |")
    return lines


def _g(v, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def _about(t: dict) -> str:
    task = t["task"]
    return (f"tool task {task['name']} ({task['prompts']} prompts, sha256 {task['sha256'][:12]}, up to {task['max_tokens']} "
            f"greedy tokens), the family's tool-call syntax `{t['syntax']}`, {t['numerics']} numerics")


def tool_markdown(d: dict) -> list[str]:
    """validation.md's tool-call section (empty without --tool-task)."""
    t = d.get("tool_calls")
    if not t:
        return []
    return ["", "## Tool calls", "",
            f"Each checkpoint against the source (the reference), K2-Vendor-Verifier's metrics: {_about(t)}. "
            "F1 over finish_reason tool_calls (TP: both call); schema accuracy: emitted calls whose name exists and "
            "whose arguments are a JSON object the tool's schema accepts.", "", *rows_markdown(t), "", t["note"] + "."]


def tool_card(validation: dict) -> list[str]:
    """The model card's tool-call section (empty without --tool-task)."""
    t = validation.get("tool_calls")
    if not t:
        return []
    return ["## Tool calls", "", f"Measured by `quantkit validate --tool-task` ({_about(t)}; source is the reference):", "",
            *rows_markdown(t), "", t["note"] + ".", ""]


def tool_caption(d: dict) -> str:
    """One line for the terminal table's caption."""
    t = d.get("tool_calls")
    if not t:
        return ""
    parts = [f"{ROWS.get(row, row)} F1 {_g(r['f1'], '.3f')} schema {_g(r['schema_accuracy'], '.3f')} ({r['tool_calls']} calling)"
             for row, r in t["rows"].items() if row != t["reference_row"]]
    return (f"\ntool calls ({t['task']['name']}, {t['task']['prompts']} prompts; source calling on "
            f"{t['rows'][t['reference_row']]['tool_calls']}): " + "; ".join(parts))
