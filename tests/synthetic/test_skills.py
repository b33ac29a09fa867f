"""quantkit.synthetic.skills: the tiny chat template renders tools and earlier calls in the tiny vocabulary,
the Python rendering training reads is the tokenizer's own, and every generated chat's call is one the
family's tool parser reads and the shipped tool task's schemas accept."""

from __future__ import annotations

import json
import random
from importlib import resources

import pytest

from quantkit.synthetic.skills import call_text, render, tool_chat
from quantkit.synthetic.tiny import encode, save_tokenizer, vocabulary
from quantkit.validation.toolcalls import parse_calls, schema_problem

SYNTAXES = ["glm45", "kimi_sections"]


def _task() -> dict:
    return json.loads(resources.files("quantkit.validation").joinpath("tooltask.json").read_text())


def _schemas() -> dict[str, dict]:
    return {t["function"]["name"]: t for p in _task()["prompts"] for t in p["tools"]}


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_render_is_the_tokenizers_chat_template(syntax, tmp_path):
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path, 512, syntax)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    unk = vocabulary().index("<unk>")
    for p in _task()["prompts"]:
        theirs = tok.apply_chat_template(p["messages"], tools=p["tools"], tokenize=False, add_generation_prompt=True)
        msgs = [m | {"calls": [c["function"]["name"] for c in m.get("tool_calls") or []]} for m in p["messages"]]
        assert render(msgs, [t["function"]["name"] for t in p["tools"]], syntax) == theirs, p["id"]
        assert unk not in encode(theirs), p["id"]  # the shipped task's prompts are all in the tiny vocabulary


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_every_generated_call_parses_and_fits_the_shipped_schemas(syntax):
    rng, schemas, calls = random.Random(0), _schemas(), 0
    unk = vocabulary().index("<unk>")
    for _ in range(200):
        chat = tool_chat(rng, syntax)
        assert unk not in encode(chat) and chat.endswith(" </s>")
        reply = chat[chat.rindex("<|assistant|>"):]
        for c in parse_calls(reply, syntax):
            calls += 1
            assert schema_problem(c, [schemas[c.name]]) is None, (c, chat)
    assert 80 < calls < 160  # most chats call a tool; the rest answer plainly
    assert parse_calls(call_text("lookup", {"name": "ada"}, syntax), syntax)[0].arguments.replace(" ", "") == '{"name":"ada"}'


def test_the_phase_trains_the_main_model_only():
    """Two steps of `train_skills` on a randomly initialised tiny GLM: every main-model Linear moves, the MTP
    layer and the routers' correction biases stay as they were."""
    import torch

    from quantkit.model.arch import arch_from_config
    from quantkit.synthetic.skills import rows, train_skills
    from quantkit.synthetic.tiny import corpus_sentence, init_weights, model_logits, tiny_config

    arch = arch_from_config(tiny_config("glm-5.2"))
    t = init_weights(arch, torch.Generator().manual_seed(0))
    ids, weights = rows(4, 33, 0, "glm45", encode, corpus_sentence)
    assert ids.shape == weights.shape == (4, 33) and set(weights.unique().tolist()) <= {1.0, 10.0}
    out = train_skills(t, arch, ids, weights, 2, 1e-3, 2, model_logits)
    mtp = arch.layer_prefix(arch.num_hidden_layers)
    moved = {k for k in t if not torch.equal(t[k], out[k])}
    assert "model.layers.1.self_attn.q_a_proj.weight" in moved and arch.head_name in moved
    assert not any(k.startswith(mtp) or k.endswith("e_score_correction_bias") for k in moved)
