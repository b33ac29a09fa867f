"""quantkit.inputs.documents: tool-call transcripts in the shapes datasets store them render as the model's
chat template renders the documented form (written out here by hand, not by the normaliser), a template
that joins arguments as strings is served, and bad records are one-line errors naming the line."""

from __future__ import annotations

import json

import pytest

from quantkit.errors import ConfigError
from quantkit.inputs.documents import document, render
from quantkit.inputs.mix import load_mix
from quantkit.inputs.tokens import load_tokens, open_tokenizer

TOOLS = [{"name": "find", "description": "find a thing", "parameters": {"type": "object", "properties": {"what": {"type": "string"}}}}]
ARGS = {"what": "cat"}

# The documented form (transformers' chat templating guide): what every stored shape must become.
OPENAI = {
    "messages": [
        {"role": "user", "content": "what does ada have ?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "functions.find:0", "function": {"name": "find", "arguments": ARGS}}]},
        {"role": "tool", "content": "a cat .", "tool_call_id": "functions.find:0", "name": "find"},
        {"role": "assistant", "content": "ada has a cat ."},
    ],
    "tools": [{"type": "function", "function": TOOLS[0]}],
}

STORED = {
    # OpenAI chat completions' own form: content null, arguments a JSON string, bare tool schemas as a JSON string
    "openai": {"messages": [
        {"role": "user", "content": "what does ada have ?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "id": "functions.find:0", "function": {"name": "find", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "content": "a cat .", "tool_call_id": "functions.find:0", "name": "find"},
        {"role": "assistant", "content": "ada has a cat ."}], "tools": json.dumps(TOOLS)},
    # LLaMA-Factory's ShareGPT with tools (glaive_toolcall_en / _zh): the call is the turn's JSON value
    "sharegpt": {"conversations": [
        {"from": "human", "value": "what does ada have ?"},
        {"from": "function_call", "value": json.dumps({"name": "find", "arguments": ARGS})},
        {"from": "observation", "value": "a cat ."},
        {"from": "gpt", "value": "ada has a cat ."}], "tools": json.dumps(TOOLS)},
    # the whole transcript stored as JSON text (apigen-style conversions)
    "json-text": {"messages": json.dumps([
        {"role": "user", "content": "what does ada have ?"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "find", "arguments": ARGS}}]},
        {"role": "tool", "content": "a cat ."},
        {"role": "assistant", "content": "ada has a cat ."}]), "tools_json": json.dumps(TOOLS)},
}


@pytest.fixture(scope="module")
def tok(tiny_kimi):
    return open_tokenizer(tiny_kimi)


# A template that writes every schema and every call's arguments as JSON: the tiny template writes names only,
# so this one is what shows the arguments and schemas survive the normaliser.
WRITES_ALL = ("{{ tools | tojson }}{% for m in messages %}{{ m['role'] + ': ' + (m['content'] or '') }}"
              "{% for c in m['tool_calls'] or [] %}{{ ' call ' + c['function']['name'] + ' ' + (c['function']['arguments'] | tojson) }}"
              "{% endfor %} {% endfor %}")


@pytest.mark.parametrize("template", ["tiny", "writes-all"])
@pytest.mark.parametrize("shape", sorted(STORED))
def test_stored_transcripts_render_as_the_documented_form(tok, shape, template, monkeypatch):
    if template == "writes-all":
        monkeypatch.setattr(tok, "chat_template", WRITES_ALL)
    want = tok.apply_chat_template(OPENAI["messages"], tools=OPENAI["tools"], tokenize=False)
    # the template writes the schema and the call: the tiny one by name and parameter, the other in full
    sentinels = ["find ( what )", "functions.find:0"] if template == "tiny" else ['"find a thing"', '{"what": "cat"}']
    assert all(s in want for s in sentinels), want
    assert render(document(STORED[shape], "t.jsonl:1"), tok, True, "t.jsonl") == want


def test_sharegpt_system_column_becomes_the_system_turn():
    d = document(STORED["sharegpt"] | {"system": "be brief ."}, "t.jsonl:1")
    assert d["messages"][0] == {"role": "system", "content": "be brief ."} and d["messages"][1]["role"] == "user"


def test_a_template_that_joins_arguments_as_a_string_is_served(tok, monkeypatch):
    """DeepSeek-V3's template concatenates a call's arguments with `+`: a mapping fails there."""
    joins = ("{% for m in messages %}{{ m['content'] }}{% for c in m['tool_calls'] or [] %}"
             "{{ ' call ' + c['function']['name'] + ' ' + c['function']['arguments'] }}{% endfor %} {% endfor %}")
    monkeypatch.setattr(tok, "chat_template", joins)
    text = render(document(STORED["sharegpt"], "t.jsonl:1"), tok, True, "t.jsonl")
    assert ' call find {"what": "cat"} ' in text


def test_without_a_chat_template_calls_are_written_as_json(tok):
    text = render(document(STORED["sharegpt"], "t.jsonl:1"), tok, False, "t.jsonl")
    assert text.splitlines()[:2] == ["what does ada have ?", ""] and '{"name": "find", "arguments": {"what": "cat"}}' in text


@pytest.mark.parametrize("row,match", [
    ({"conversations": [{"from": "function_call", "value": "{not json"}]}, r"t.jsonl:3: a function_call turn is not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     r"t.jsonl:3: a tool call needs a string name and an object of arguments"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"description": "no name"}]},
     r"t.jsonl:3: each tool must be a function schema with a name"),
    ({"messages": "[{]"}, r"t.jsonl:3: messages is not valid JSON"),
])
def test_bad_transcripts_are_one_line_errors_naming_the_line(row, match):
    with pytest.raises(ConfigError, match=match) as e:
        document(row, "t.jsonl:3")
    assert "\n" not in str(e.value)


def test_a_mix_with_a_tool_call_source_counts_its_tokens(tmp_path, tiny_kimi):
    """Chat plus tool-call transcripts in one calibration set: the transcripts arrive rendered by the chat
    template (here one that writes calls in the tiny vocabulary's words), and the record gives each
    source's windows and tokens."""
    import shutil

    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_kimi / name, folder / name)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' ' }}"
                            "{% for c in m['tool_calls'] or [] %}{{ c['function']['name'] + ' ' }}"
                            "{% for k, v in c['function']['arguments'].items() %}{{ k + ' ' + v + ' ' }}{% endfor %}"
                            "{% endfor %}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"what does ada have ? {i}"},
                                                      {"role": "assistant", "content": "a cat ."}]}) + "\n" for i in range(40)))
    calls = tmp_path / "calls.jsonl"
    row = {"conversations": [{"from": "human", "value": "what does ada have ?"},
                             {"from": "function_call", "value": json.dumps({"name": "finds", "arguments": ARGS})},
                             {"from": "observation", "value": "a cat ."}, {"from": "gpt", "value": "ada has a cat ."}]}
    calls.write_text("".join(json.dumps(row) + "\n" for _ in range(20)))
    mixed = load_mix([(str(chat), 6), (str(calls), 2)], tokenizer=folder, seq_len=16)
    assert [(r["windows"], r["tokens"]) for r in mixed.source["sources"]] == [(6, 96), (2, 32)]
    alone = load_tokens(str(calls), tokenizer=folder, num_samples=2, seq_len=16)
    words = open_tokenizer(folder)("<|user|> what does ada have ? <|assistant|>  finds what cat <|tool|> a cat .",
                                   add_special_tokens=False)["input_ids"]
    assert alone.ids[0].tolist()[1:1 + len(words)] == words  # BOS, then the call as the template writes it
    assert sum(any(m.tolist() == a.tolist() for m in mixed.ids) for a in alone.ids) == 2
