"""quantkit.validation.toolcalls: the tool task, each family's tool-call syntax, schema accuracy and the
finish_reason F1 on hand-made generations (the tiny models never write a tool call: see the end-to-end
test), and `validate --tool-task` on the tiny GLM (rows, counts, validation.md, both cards)."""

from __future__ import annotations

import json

import pytest

from quantkit.errors import ConfigError
from quantkit.validation.toolcalls import Call, Generation, compare, paired_f1, parse_calls, read_tool_task, schema_problem

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_default_task_reads_and_every_prompt_has_schemas():
    t = read_tool_task("default")
    assert t.name == "quantkit-tools-v1" and len(t.prompts) == 6 and t.max_tokens == 16
    assert all(p.tools and all("parameters" in x["function"] for x in p.tools) for p in t.prompts)


def test_task_without_schemas_is_one_line_naming_file_and_prompt(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"prompts": [{"id": "ok", "messages": [{"role": "user", "content": "x"}], "tools": [ADD]},
                                         {"id": "bare", "messages": [{"role": "user", "content": "y"}]}]}))
    with pytest.raises(ConfigError, match=rf"{f}: prompt 'bare' has no tool schemas") as e:
        read_tool_task(f)
    assert "\n" not in str(e.value)
    f2 = tmp_path / "t.jsonl"  # JSONL, one request body per line; a tool without `parameters`
    f2.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "add"}}]}) + "\n")
    with pytest.raises(ConfigError, match=r"t.jsonl: prompt '0', tool 'add' has no schema"):
        read_tool_task(f2)


@pytest.mark.parametrize("syntax, text", [
    ("hermes", 'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'),
    ("kimi_sections", "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
                '{"a": 1, "b": 2}<|tool_call_end|><|tool_calls_section_end|>'),
    ("glm45", "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"),
    ("deepseek_fences", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
                    '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
])
def test_each_family_syntax_parses_to_the_same_call(syntax, text):
    (c,) = parse_calls(text, syntax)
    assert c.name == "add" and json.loads(c.arguments) == {"a": 1, "b": 2}
    assert schema_problem(c, [ADD]) is None
    assert parse_calls("the quick cat chases the", syntax) == []


def test_every_family_names_a_known_syntax():
    from quantkit.model.families import REGISTRY
    from quantkit.validation.toolcalls import SYNTAXES

    assert {f.tool_calls for f in REGISTRY.values()} <= set(SYNTAXES)


def test_schema_problems_are_named():
    assert schema_problem(Call("sub", "{}"), [ADD]) == "no tool named 'sub'"
    assert schema_problem(Call("add", '{"a": 1,'), [ADD]).startswith("arguments are not JSON")
    assert schema_problem(Call("add", "[1, 2]"), [ADD]) == "arguments are a JSON list, not an object"
    assert "'b' is a required property" in schema_problem(Call("add", '{"a": 1}'), [ADD])
    assert "is not of type 'integer'" in schema_problem(Call("add", '{"a": "1", "b": 2}'), [ADD])


def test_f1_and_schema_accuracy_on_a_checkpoint_that_drops_adds_and_breaks_calls(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"prompts": [{"id": f"p{i}", "messages": [{"role": "user", "content": "x"}], "tools": [ADD]}
                                         for i in range(5)]}))
    task = read_tool_task(f)
    good, bad = Call("add", '{"a": 1, "b": 2}'), Call("add", '{"a": "one"}')

    def tc(*calls):
        return Generation("tool_calls", list(calls))

    stop = Generation("stop")
    source = [tc(good), tc(good), tc(good), stop, stop]
    ckpt = [tc(good), stop, tc(bad), tc(good, good), stop]  # p1 dropped, p2 arguments break the schema, p3 added
    r = compare(source, ckpt, task)
    assert (r["tp"], r["fp"], r["fn"], r["tn"]) == (2, 1, 1, 1)
    assert r["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1)) and r["precision"] == r["recall"] == pytest.approx(2 / 3)
    assert (r["calls"], r["schema_valid"]) == (4, 3) and r["schema_accuracy"] == 0.75
    assert r["call_rate_delta"] == 0.0 and r["call_rate_delta_stderr"] == pytest.approx(0.3162, abs=1e-4)
    assert [c["problem"] is None for c in r["per_prompt"][2]["calls"]] == [False]
    # SEs over prompts: jackknife for the ratios (leave-one-out F1s 0.5, 0.8, 0.5, 0.8, 2/3)
    assert r["f1_stderr"] == pytest.approx(0.26866, abs=1e-4)
    assert r["schema_accuracy_delta"] == pytest.approx(-0.25) and r["schema_accuracy_delta_stderr"] > 0
    d, se = paired_f1(source, ckpt, source)  # this checkpoint against one that agrees with the source everywhere
    assert d == pytest.approx(2 / 3 - 1) and se == pytest.approx(r["f1_stderr"])
    same = compare(source, source, task)
    assert same["f1"] == 1.0 and same["schema_accuracy"] == 1.0
    none = compare([stop] * 5, [stop] * 5, task)
    assert none["f1"] is None and none["schema_accuracy"] is None and none["tn"] == 5


@pytest.fixture(scope="module")
def validated(tmp_path_factory, tiny_glm):
    """The tiny GLM pair validated with three of the shipped tool prompts at 4 tokens (the whole task's cost
    is 6 prompts x 16 tokens on every row; the rows and counts are the same code)."""
    from quantkit.conversion.pipeline import convert
    from quantkit.validation.pipeline import validate

    root = tmp_path_factory.mktemp("tools")
    task = json.loads(_shipped())
    task.update(name="tools-3", max_tokens=4, prompts=task["prompts"][3:])  # two-tools, no-call, recall-result
    (root / "tools.json").write_text(json.dumps(task))
    out = convert("tiny:glm-5.2", root / "glm", method="rtn", validate=False, progress=False).out
    res = validate(out, num_samples=1, seq_len=8, gen_tokens=2, device="cpu", progress=False, tool_task=root / "tools.json",
                   kv_cache_dtype="fp8_ds_mla", long_context=0)
    return out, res.data


def _shipped() -> str:
    from importlib import resources

    return resources.files("quantkit.validation").joinpath("tooltask.json").read_text()


def test_validate_tool_task_rows_cards_and_markdown(validated):
    out, d = validated
    t = d["tool_calls"]
    assert t["syntax"] == "glm45" and t["numerics"] == d["numerics"]["mode"] == "engine"
    assert t["task"]["prompts"] == 3 and t["task"]["name"] == "tools-3"
    assert list(t["rows"]) == ["reference", "prefill", "decode", "decode_kv"]
    for r in t["rows"].values():  # every prompt ran on every row and is accounted for
        assert [p["id"] for p in r["per_prompt"]] == ["two-tools", "no-call", "recall-result"]
        assert r["prompts"] == 3 and r["tp"] + r["fp"] + r["fn"] + r["tn"] == 3
        assert all(p["this"] in ("tool_calls", "stop", "length") and p["text"] for p in r["per_prompt"])
    # the tiny models never write GLM's <tool_call> syntax: nothing to agree on, and the record says so
    assert all(r["tool_calls"] == 0 and r["f1"] is None for r in t["rows"].values())
    assert "F1 and schema accuracy are undefined" in t["note"]
    md = (out / "validation.md").read_text()
    assert "## Tool calls" in md and "| decode (INT4) | 3 | 0 / 0 |" in md
    for which in ("prefill", "decode"):
        card = (out / which / "README.md").read_text()
        assert "## Tool calls" in card and "engine numerics" in card and "tools-3 (3 prompts" in card, which


def test_validate_bad_tool_task_is_one_line(validated, tmp_path):
    from quantkit.validation.pipeline import validate

    out, _ = validated
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"prompts": [{"id": "q", "messages": [{"role": "user", "content": "x"}], "tools": []}]}))
    with pytest.raises(ConfigError, match=rf"{f}: prompt 'q' has no tool schemas") as e:
        validate(out, device="cpu", progress=False, tool_task=f)
    assert "\n" not in str(e.value)


def test_the_tool_task_reports_progress_per_token(tiny_glm, capsys):
    """Off a terminal, a stderr line per sixteenth of the greedy steps (here, with 2 steps, per step; every row
    and prompt in lockstep), so a long tool task is never silent, and the count never passes the total."""
    import torch

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.validation.toolcalls import run_tool_task

    task = read_tool_task("default")
    task.prompts, task.max_tokens = task.prompts[:2], 2
    with torch.no_grad():
        t = run_tool_task(task, {"reference": Checkpoint(tiny_glm)}, tiny_glm, {}, torch.device("cpu"), torch.float32, 16,
                          progress=True)
    assert t["rows"]["reference"]["prompts"] == 2
    err = capsys.readouterr().err
    steps = [line.split("  ")[0] for line in err.splitlines()]
    assert steps == [f"validate: tool task, greedy step {i}/2" for i in range(3)], err
