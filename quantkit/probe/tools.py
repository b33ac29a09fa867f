"""The probe's tool calls, K2-Vendor-Verifier-style: the tool task's prompts sent with `tools=` to the
endpoint's chat API, checked for an endpoint that has no tool support before anything is computed
(a 400 to `tools=` is caught in quantkit.probe.client.Endpoint.chat_tools), and the lines the probe
prints. The metrics are validate's (quantkit.validation.toolcalls), the source being the reference."""

from __future__ import annotations

from quantkit.probe.client import ProbeError, ToolReply
from quantkit.validation.toolcalls import ROWS, ToolTask, parse_calls, render


def check_tool_replies(url: str, task: ToolTask, replies: list[ToolReply], tok, syntax: str) -> list[list[int]]:
    """The prompts' token ids with their tools; a ProbeError (one line) when the answers show the server
    ignores `tools=`: a call written as text in `content` with no `tool_calls` (no tool-call parser), or
    a prompt token count that is the chat template's without the tools."""
    ids, bare = render(task, tok), render(task, tok, tools=False)
    for p, r, with_tools, without in zip(task.prompts, replies, ids, bare):
        if not r.calls and parse_calls(r.text, syntax):
            raise ProbeError(f"{url}/chat/completions: prompt {p.id}: the answer writes a tool call in message.content "
                             f"({syntax} syntax) and returns no message.tool_calls; the endpoint does not parse tool calls "
                             "(start it with the model's --tool-call-parser)")
        if r.prompt_tokens is not None and r.prompt_tokens == len(without) != len(with_tools):
            raise ProbeError(f"{url}/chat/completions: prompt {p.id}: the server computed on {r.prompt_tokens} prompt tokens, "
                             f"the chat template without the tools ({len(with_tools)} with them); it ignores tools=")
    return ids


def tool_lines(t: dict | None) -> list[str]:
    """The probe's printed tool-call summary (nothing without --tool-task)."""
    if not t:
        return []
    ref, ep = t["rows"][t["reference_row"]], t["rows"]["endpoint"]
    f1 = "—" if ep["f1"] is None else f"{ep['f1']:.3f}"
    acc = "—" if ep["schema_accuracy"] is None else f"{ep['schema_accuracy']:.3f}"
    out = [f"tool calls ({t['task']['name']}, {t['task']['prompts']} prompts; {ROWS['reference']} computed here in "
           f"{t['numerics']} numerics, {t['syntax']} syntax): finish_reason tool_calls endpoint {ep['tool_calls']} / source "
           f"{ref['tool_calls']} (TP {ep['tp']} FP {ep['fp']} FN {ep['fn']} TN {ep['tn']}), F1 {f1}; schema accuracy {acc} "
           f"({ep['schema_valid']}/{ep['calls']} calls)"]
    out += [f"  {p['id']}: {c['name']}: {c['problem']}" for p in ep["per_prompt"] for c in p["calls"] if c["problem"]]
    return out
