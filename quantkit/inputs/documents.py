"""One calibration or evaluation record, as text the model's tokenizer will see.

A record is plain text (`text`), a chat (`messages`, or ShareGPT's `conversations`), or a tool-call
transcript: a chat whose assistant turns call tools, with the tools' schemas beside it. Transcripts
matter for calibration because an engine serves tool calls through the model's own chat template:
Kimi K2 wraps each call in `<|tool_calls_section_begin|>` ... `<|tool_call_argument_begin|>` tokens,
GLM in `<tool_call>` / `<arg_key>` ones, and the tools' schemas go into a system turn the template
writes. Experts that those tokens route to are calibrated only if the calibration set contains them,
rendered the same way, so a transcript is normalized to the form transformers' `apply_chat_template`
documents (`tools=[{"type": "function", "function": {...}}]`, assistant `tool_calls` with a name and
a mapping of arguments, `tool` turns for the results) and rendered by the model's template.

The record shapes read (a Hub dataset's row, a JSON Lines line, a parquet row):

    {"text": "..."}
    {"messages": [{"role": "user", "content": "..."}, ...]}                 OpenAI / HF chat
    {"messages": [..., {"role": "assistant", "content": null,
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{...}"}}]},
                  {"role": "tool", "tool_call_id": "...", "content": "..."}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {...}}}]}
    {"conversations": [{"from": "human", "value": "..."}, {"from": "function_call", "value": "{\"name\": ...}"},
                       {"from": "observation", "value": "..."}, {"from": "gpt", "value": "..."}],
     "tools": "[{\"name\": \"f\", \"parameters\": {...}}]", "system": "..."}   ShareGPT with tools (LLaMA-Factory's)

`messages` and `tools` may be JSON strings (datasets that store them so), a tool may be a bare
`{name, description, parameters}` schema, and a call's `arguments` a JSON string: each is brought to
the documented form. A call without an id gets Kimi's `functions.NAME:INDEX`, which other templates
ignore, and a following result without a `tool_call_id` is tied to it.

Templates differ on one point: most read a call's arguments as a mapping, a few (DeepSeek-V3's) join
them as a string. A transcript is rendered with mappings first and, if the template fails on that,
with JSON strings; a template that fails on both is an error naming the dataset.
"""

from __future__ import annotations

import json
from typing import Any

from quantkit.errors import ConfigError

__all__ = ["document", "render"]

_ROLES = {"human": "user", "gpt": "assistant", "model": "assistant", "observation": "tool",
          "function_call": "assistant", "tool_call": "assistant"}  # ShareGPT `from` values
_CALL_ROLES = ("function_call", "tool_call")  # ShareGPT turns whose value is the call itself, as JSON


def document(row: Any, where: str) -> dict:
    """Normalize one record to {"text": str} and/or {"messages": [...], "tools": [...]} (module docstring)."""
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected an object with \"text\" or \"messages\", got {type(row).__name__}")
    doc: dict = {}
    if isinstance(row.get("text"), str):
        doc["text"] = row["text"]
    msgs = row.get("messages", row.get("conversations"))
    if isinstance(msgs, str):
        msgs = _json(msgs, where, "messages")
    if msgs is not None:
        doc["messages"] = _messages(msgs, where)
        system = row.get("system")  # ShareGPT keeps the system prompt beside the turns
        if isinstance(system, str) and system and (not doc["messages"] or doc["messages"][0]["role"] != "system"):
            doc["messages"].insert(0, {"role": "system", "content": system})
        tools = row.get("tools", row.get("tools_json"))
        if isinstance(tools, str):
            tools = _json(tools, where, "tools") if tools.strip() else None
        if tools:
            doc["tools"] = _tools(tools, where)
    if not doc:
        raise ConfigError(f"{where}: no \"text\" string or \"messages\"/\"conversations\" list "
                          f"(fields: {', '.join(sorted(row)) or 'none'}); add one of them")
    return doc


def render(doc: dict, tok, chat_template: bool, spec: str) -> str:
    """Chat documents through the chat template (when asked), else the plain text."""
    if "messages" not in doc or not (chat_template or "text" not in doc):
        return doc["text"]
    if not chat_template:
        return "\n".join(_plain(m) for m in doc["messages"])
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{spec}: chat documents but the tokenizer has no chat template; "
                          "add one to tokenizer_config.json or turn chat templates off (chat_template=False)")
    tools = doc.get("tools")
    if not any("tool_calls" in m for m in doc["messages"]):
        return tok.apply_chat_template(doc["messages"], tools=tools, tokenize=False)
    try:
        return tok.apply_chat_template(doc["messages"], tools=tools, tokenize=False)
    except Exception as first:  # jinja raises TypeError, UndefinedError, TemplateError... on the argument form
        try:
            return tok.apply_chat_template(_string_arguments(doc["messages"]), tools=tools, tokenize=False)
        except Exception:  # the first failure is the one to report
            raise ConfigError(f"{spec}: the tokenizer's chat template cannot render a tool-call transcript with "
                              f"arguments as a mapping or as a JSON string ({type(first).__name__}: "
                              f"{str(first).splitlines()[0] if str(first) else ''}); check the records' tool_calls, "
                              "or leave this source out of the mix") from None


# ---- messages ------------------------------------------------------------------------------------
def _messages(msgs: Any, where: str) -> list[dict]:
    if not isinstance(msgs, list):
        raise ConfigError(f"{where}: messages must be a list of {{role, content}} objects")
    out: list[dict] = []
    calls: list[dict] = []  # every call so far, for results without a tool_call_id
    for m in msgs:
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: each message must be an object with role and content")
        sharegpt = m.get("from")
        role = m.get("role", _ROLES.get(sharegpt, sharegpt))
        content = m.get("content", m.get("value"))
        if isinstance(content, list):  # multimodal parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
        if sharegpt in _CALL_ROLES:  # the value is the call (or a list of calls), as JSON
            raw = _json(content, where, f"a {sharegpt} turn") if isinstance(content, str) else content
            m, content = {"tool_calls": raw if isinstance(raw, list) else [raw]}, ""
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise ConfigError(f"{where}: a message lacks a string role or content; use {{\"role\": ..., \"content\": ...}}")
        msg = {"role": role, "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, len(calls) + i, where) for i, c in enumerate(_list(m["tool_calls"], where))]
            calls += msg["tool_calls"]
        if role == "tool":
            msg |= _result_of(m, calls, sum(1 for o in out if o["role"] == "tool"))
        out.append(msg)
    return out


def _call(c: Any, index: int, where: str) -> dict:
    """One tool call as transformers documents it: {"type": "function", "id", "function": {"name", "arguments": {...}}}."""
    if not isinstance(c, dict):
        raise ConfigError(f"{where}: a tool call must be an object with a name and arguments")
    f = c.get("function", c)
    name, args = f.get("name"), f.get("arguments", f.get("parameters", {}))
    if isinstance(args, str):
        args = _json(args, where, f"tool call {name!r}'s arguments") if args.strip() else {}
    if not isinstance(name, str) or not isinstance(args, dict):
        raise ConfigError(f"{where}: a tool call needs a string name and an object of arguments "
                          f"(got name {name!r}, arguments {type(args).__name__})")
    return {"type": "function", "id": c.get("id") or f"functions.{name}:{index}", "function": {"name": name, "arguments": args}}


def _result_of(m: dict, calls: list[dict], k: int) -> dict:
    """A tool result's tool_call_id and name: its own, else the k-th call's (results follow calls in order)."""
    out = {key: m[key] for key in ("tool_call_id", "name") if isinstance(m.get(key), str)}
    if "tool_call_id" not in out and k < len(calls):
        out["tool_call_id"] = calls[k]["id"]
        out.setdefault("name", calls[k]["function"]["name"])
    return out


def _tools(tools: Any, where: str) -> list[dict]:
    """Tool schemas as {"type": "function", "function": {name, description, parameters}}."""
    out = []
    for t in _list(tools, where):
        if not isinstance(t, dict) or not isinstance(t.get("function", t).get("name"), str):
            raise ConfigError(f"{where}: each tool must be a function schema with a name")
        out.append(t if "function" in t else {"type": "function", "function": t})
    return out


def _string_arguments(msgs: list[dict]) -> list[dict]:
    """The same messages with each call's arguments as a JSON string (for templates that join them)."""
    return [m | {"tool_calls": [c | {"function": c["function"] | {"arguments": json.dumps(c["function"]["arguments"],
                                                                                        ensure_ascii=False)}}
                                for c in m["tool_calls"]]} if "tool_calls" in m else m for m in msgs]


def _plain(m: dict) -> str:
    """A message without a chat template: its content, then its calls as JSON."""
    calls = [json.dumps(c["function"], ensure_ascii=False) for c in m.get("tool_calls", [])]
    return "\n".join([m["content"], *calls]) if calls else m["content"]


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise ConfigError(f"{where}: expected a list, got {type(v).__name__}")
    return v


def _json(text: Any, where: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: {what} is not valid JSON ({e}); store it as JSON text or as a list") from None
