"""quantkit probe --tool-task against a fake OpenAI-compatible server on 127.0.0.1 (test_probe.py's loopback
pattern): the endpoint's tool calls scored against the source's (F1 on finish_reason tool_calls, schema
accuracy of its calls), and an endpoint without tool support (400 to tools=, tools ignored, calls left
in the text) as one line and a non-zero exit."""

from __future__ import annotations

import json
from http.server import ThreadingHTTPServer

import pytest
from test_probe import JSONHandler, Loopback, rtn_pair

from quantkit.probe.client import ProbeError
from quantkit.probe.pipeline import probe

# the main prompt set kept to one short chat prompt: the tool prompts are what is under test
PROMPTS = {"name": "test-tools", "max_tokens": 2, "top_logprobs": 5, "prompts": [
    {"id": "chat-cat", "kind": "chat", "messages": [{"role": "user", "content": "the quick cat chases the"}]}]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_glm):
    root = tmp_path_factory.mktemp("probe-tools")
    out, prompts = rtn_pair(root, PROMPTS)
    from importlib import resources

    task = json.loads(resources.files("quantkit.validation").joinpath("tooltask.json").read_text())
    task.update(name="tools-3", max_tokens=4, prompts=[p for p in task["prompts"] if p["id"] in ("add", "count", "no-call")])
    (root / "tools.json").write_text(json.dumps(task))
    return out, prompts, root / "tools.json"


class ToolServer(Loopback):
    """/v1/models and /v1/chat/completions; a request with `tools=` is answered as `mode` says: "calls" (a
    valid call to `add` on the add prompt, a schema-breaking call to `count` on the count prompt, text
    elsewhere), "refuse" (400), "ignore" (text, prompt_tokens of the template without the tools) or
    "text" (GLM's tool-call syntax in content, no tool_calls)."""

    def __init__(self, mode: str, tokenizer_dir):
        from transformers import AutoTokenizer

        tok, outer = AutoTokenizer.from_pretrained(str(tokenizer_dir)), self
        self.requests: list[dict] = []

        class Handler(JSONHandler):
            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append(body)
                msg, finish, usage = {"role": "assistant", "content": "a"}, "length", {}
                if "tools" in body:
                    if mode == "refuse":
                        return self._send(400, {"error": {"message": "\"auto\" tool choice requires --enable-auto-tool-choice"}})
                    text = body["messages"][0]["content"]
                    finish = "stop"
                    if mode == "calls" and "add tool" in text:
                        msg, finish = {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {
                            "name": "add", "arguments": json.dumps({"a": 12, "b": 5})}}]}, "tool_calls"
                    elif mode == "calls" and "counter" in text:
                        msg, finish = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                            "name": "count", "arguments": json.dumps({"start": "8", "n": 0})}}]}, "tool_calls"
                    elif mode == "text":
                        msg = {"role": "assistant", "content": "<tool_call>add<arg_key>a</arg_key><arg_value>12</arg_value></tool_call>"}
                    elif mode == "ignore":
                        ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
                        usage = {"prompt_tokens": len(ids["input_ids"] if hasattr(ids, "keys") else ids)}
                self._send(200, {"object": "chat.completion", "model": "tiny", "usage": usage,
                                 "choices": [{"index": 0, "message": msg, "finish_reason": finish}]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


def test_endpoint_tool_calls_scored_against_the_source(pair):
    out, prompts, tools = pair
    with ToolServer("calls", out / "decode") as srv:
        res = probe(srv.url, out, prompts=prompts, kv_cache_dtype="bf16", device="cpu", tool_task=tools)
    sent = [b for b in srv.requests if "tools" in b]
    assert len(sent) == 3 and all(b["temperature"] == 0 and b["max_tokens"] == 4 and b["tools"] for b in sent)
    t = res.data["tool_calls"]
    assert t["reference_row"] == "reference" and t["numerics"] == "engine" and t["syntax"] == "glm45"
    src, ep = t["rows"]["reference"], t["rows"]["endpoint"]
    # the tiny source never calls a tool; the endpoint calls on 2 prompts, one call breaking count's schema
    assert src["tool_calls"] == 0 and src["prompts"] == ep["prompts"] == 3
    assert (ep["tp"], ep["fp"], ep["fn"], ep["tn"]) == (0, 2, 0, 1) and ep["f1"] == 0.0
    assert (ep["calls"], ep["schema_valid"], ep["schema_accuracy"]) == (2, 1, 0.5)
    bad = [c for p in ep["per_prompt"] for c in p["calls"] if c["problem"]]
    assert [c["name"] for c in bad] == ["count"] and "is not of type 'integer'" in bad[0]["problem"]
    lines = res.lines()
    assert any(x.startswith("tool calls (tools-3, 3 prompts") and "F1 0.000" in x and "schema accuracy 0.500 (1/2 calls)" in x
               for x in lines), lines


def _cli_error(*args) -> str:
    """`quantkit probe ARGS` in this process (typer's CliRunner): exit 1 and one line."""
    from typer.testing import CliRunner

    from quantkit.cli import app

    r = CliRunner().invoke(app, ["probe", *map(str, args)])
    lines = [x for x in (r.stderr or r.output).strip().splitlines() if x.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error:"), (r.output, r.stderr)
    return lines[0]


def test_endpoint_refusing_tools_is_one_line(pair):
    out, prompts, tools = pair
    with ToolServer("refuse", out / "decode") as srv:
        line = _cli_error(srv.url, "--pair", out, "--prompts", prompts, "--tool-task", tools, "--kv-cache-dtype", "bf16")
    assert "400 to a request with tools=" in line and "no tool support" in line and "--tool-call-parser" in line


def test_endpoint_ignoring_tools_is_one_line(pair):
    out, prompts, tools = pair
    with ToolServer("ignore", out / "decode") as srv, pytest.raises(ProbeError) as e:
        probe(srv.url, out, prompts=prompts, kv_cache_dtype="bf16", device="cpu", tool_task=tools)
    line = str(e.value)
    assert "\n" not in line and "prompt add: the server computed on 13 prompt tokens" in line and "it ignores tools=" in line


def test_endpoint_without_a_tool_parser_is_named(pair):
    out, prompts, tools = pair
    with ToolServer("text", out / "decode") as srv, pytest.raises(ProbeError, match="returns no message.tool_calls"):
        probe(srv.url, out, prompts=prompts, kv_cache_dtype="bf16", device="cpu", tool_task=tools)
