"""What a tiny model would learn after its corpus steps to call tools: the data and the phase.

The corpus (quantkit.synthetic.tiny) makes perplexity, KL and top-1 mean something, but a model
trained on it alone never writes a tool call, so validate's tool-call rows read "0 calls, F1 —".
This module holds what a tool-calling tiny model needs: the words (`TOOL_WORDS`, appended to the
tiny vocabulary so every corpus word keeps its id), the chat template the tiny tokenizers ship
(`chat_template`: tools as their names and parameters, earlier calls in the family's syntax), the
same rendering in Python (`render`), chats drawn from the shipped tool task's kinds of request
(`tool_chat`: a request answered by a call in the family's syntax, glm45 or kimi_sections, or a
plain answer), and a fine-tuning phase on them (`rows`, `train_skills`).

The phase is in no tiny model's `PHASES` yet. Its settings (quantkit.synthetic.tiny: 240 steps at
lr 2e-3, rows of 97 tokens, each a chat then corpus sentences, the reply weighted 10) were chosen on
two builds of each of the tiny GLM and Kimi (seeds 0, 1) among 120-800 steps, lr 1e-3 to 3e-3, a chat
in 60-100% of the rows, rows of 49 or 97 tokens and reply weights 5 or 10, then run once on three
more builds of each (seeds 2-4). Measured in memory (fp32 weights, quantkit's reference forward) on
the shipped task's 6 prompts, 4 of which ask for a call:
- tuning builds: 4 calls on the 4, all schema-valid, plain answers on the other 2, on all four;
- confirmation builds: the same on five of six; the tiny Kimi at seed 2 called on the 4 with 3
  valid (75%, under the 90% a source's tool row needs);
- the corpus perplexity stays within 0.9-1.1x the main steps' on the GLM, rises 1.06-1.36x on the Kimi,
  and the GLM's RTN-expert KL moved 1.0-3.7x (0.0047 -> 0.0143 at seed 2), so every gate measured
  on the tiny GLM would be re-derived over its builds (scripts/gate_margins.py) in the same change;
- rows of 49 tokens (a chat fills most of the row) reached the call bar too, but the corpus perplexity
  rose to 1.3-1.8x and the RTN KL 2-6x; with 60% chats and weight 5 the tiny Kimi chose the wrong
  tool (3 of 4 or 2 of 3 valid).
What no setting taught: argument values. A tiny model copies no number from its prompt in 800 steps
(`add` with a = b = 14 whatever the request says), nor does the main model answer the corpus's own
recall sentences ("remember ada has a fox . ... what does ada have ? a" -> fox on 5 of 40 at a
one-sentence gap, chance 2.5), so a retrieval (needle) row waits for a model that retrieves too.
"""

from __future__ import annotations

import random

import torch

__all__ = ["TOOL_WORDS", "call_text", "chat_template", "render", "rows", "tool_chat", "train_skills"]

_NOUNS = "cat dog fox bird fish horse mouse lion bear wolf frog duck goat owl crab seal".split()
_ADJS = "red blue green small big quick lazy old young happy sad bright dark calm wild".split()
_VERBS = "sees chases likes finds follows helps meets watches".split()
_NAMES = "ada bob cy dee eve fay gus hal ivy jo kai lu".split()
TOOLS = {"add": ("a", "b"), "subtract": ("a", "b"), "lookup": ("name",), "count": ("start", "n")}
_GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>")
# Words the skills need beyond the corpus's; the vocabulary appends them, so every corpus word keeps its id.
TOOL_WORDS = (
    "<|system|>", "<|tool|>", "tools", "(", ")", *TOOLS, "b", "name", "start", "n", "use", "tool", "look", "it",
    "up", "on", "from", "with", "counter", *_GLM, *_KIMI, "{", "}", ",",
    *(f"functions.{t}:0" for t in TOOLS), *(f'"{k}"' for k in ("a", "b", "name", "start", "n")), *(f'"{n}"' for n in _NAMES),
)


# ---- the chat template ----------------------------------------------------------------------------
def chat_template(syntax: str | None) -> str:
    """The tiny tokenizer's chat template: tools as their names and parameters after a `<|system|>` turn,
    each message after its role, an assistant's earlier calls in the family's syntax (names only; the
    result follows in a `<|tool|>` turn). Without tools or calls the text is `<|role|> content ` per
    message, as it always was."""
    if syntax == "glm45":
        call = "{{ '<tool_call> ' + c.function.name + ' </tool_call> ' }}"
    elif syntax == "kimi_sections":
        call = ("{{ '<|tool_calls_section_begin|> <|tool_call_begin|> functions.' + c.function.name + ':0 "
                "<|tool_call_argument_begin|> <|tool_call_end|> <|tool_calls_section_end|> ' }}")
    else:
        call = "{{ (c | tojson) + ' ' }}"
    return (
        "{% if tools %}{{ '<|system|> tools : ' }}{% for t in tools %}{{ t.function.name + ' ( ' }}"
        "{% for k in (t.function.parameters.properties or {}) %}{{ k + ' ' }}{% endfor %}{{ ') ' }}{% endfor %}"
        "{{ '. ' }}{% endif %}"
        "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + (m['content'] or '') + ' ' }}"
        "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}" + call + "{% endfor %}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
    )


def render(messages: list[dict], tools: list[str], syntax: str, generation_prompt: bool = True) -> str:
    """`chat_template(syntax)` rendered in Python for the tools named `tools` (what training reads;
    tests/synthetic hold it to the tokenizer's own rendering)."""
    out = ""
    if tools:
        out += "<|system|> tools : " + "".join(f"{t} ( " + "".join(f"{k} " for k in TOOLS[t]) + ") " for t in tools) + ". "
    for m in messages:
        out += f"<|{m['role']}|> {m.get('content') or ''} "
        for name in m.get("calls", ()):
            out += (f"<tool_call> {name} </tool_call> " if syntax == "glm45" else
                    f"<|tool_calls_section_begin|> <|tool_call_begin|> functions.{name}:0 <|tool_call_argument_begin|> "
                    "<|tool_call_end|> <|tool_calls_section_end|> ")
    return out + ("<|assistant|> " if generation_prompt else "")


def call_text(name: str, args: dict, syntax: str) -> str:
    """One tool call in the family's syntax, as the engines' parsers read it (quantkit.validation.toolcalls)."""
    if syntax == "glm45":
        return (f"<tool_call> {name} " + "".join(f"<arg_key> {k} </arg_key> <arg_value> {v} </arg_value> " for k, v in args.items())
                + "</tool_call>")
    body = " , ".join(f'"{k}" : ' + (f'"{v}"' if isinstance(v, str) else str(v)) for k, v in args.items())
    return (f"<|tool_calls_section_begin|> <|tool_call_begin|> functions.{name}:0 <|tool_call_argument_begin|> {{ {body} }} "
            "<|tool_call_end|> <|tool_calls_section_end|>")


# ---- the data ---------------------------------------------------------------------------------------
def filler(rng: random.Random) -> str:
    """A sentence of the corpus's agreement kind (a plain answer finishes one)."""
    return f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} ."


def tool_chat(rng: random.Random, syntax: str) -> str:
    """One chat with tools: a request answered by a call (most), or a plain answer (a sentence to finish,
    or the answer after the tool's result), ending in </s>."""
    a, b, name, thing = rng.randrange(21), rng.randrange(21), rng.choice(_NAMES), rng.choice(_NOUNS)
    kind = rng.randrange(7)
    if kind in (0, 1):  # arithmetic: the tool the request names, among one or two
        op = ("add", "subtract")[kind]
        if op == "subtract":
            a = a + b
        tools = [op] if rng.random() < 0.4 else rng.sample(["add", "subtract"], 2)
        ask = f"what is {a} {'plus' if op == 'add' else 'minus'} {b} ?" + (f" use the {op} tool ." if rng.random() < 0.5 else "")
        return render([{"role": "user", "content": ask}], tools, syntax) + call_text(op, {"a": a, "b": b}, syntax) + " </s>"
    if kind == 2:
        ask = (f"remember {name} has a {thing} . " if rng.random() < 0.5 else "") + f"what does {name} have ?" + (
            " look it up ." if rng.random() < 0.5 else "")
        return render([{"role": "user", "content": ask}], ["lookup"], syntax) + call_text("lookup", {"name": name}, syntax) + " </s>"
    if kind == 3:
        s = rng.randrange(30)
        ask = f"count : {s} {s + 1} {s + 2} . then count on from {s + 3} with the counter ."
        return render([{"role": "user", "content": ask}], ["count"], syntax) + call_text("count", {"start": s + 3}, syntax) + " </s>"
    if kind in (4, 5):  # a sentence to finish: no call
        words = filler(rng).split()
        cut = rng.randrange(2, 6)
        tools = [rng.choice(list(TOOLS))]
        return render([{"role": "user", "content": " ".join(words[:cut])}], tools, syntax) + " ".join(words[cut:]) + " </s>"
    chat: list[dict] = [{"role": "user", "content": f"what does {name} have ?"}, {"role": "assistant", "content": "", "calls": ["lookup"]},
            {"role": "tool", "content": f"{name} has a {thing}"}]
    return render(chat, ["lookup"], syntax) + f"{name} has a {thing} . </s>"


# ---- the phase ----------------------------------------------------------------------------------------
def rows(n: int, length: int, seed: int, syntax: str, encode, corpus_sentence, *, share: float = 1.0,
         reply_weight: float = 10.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, length) training rows and their loss weights: a tool chat first (`share` of the rows, at position 0
    as a chat is served), then corpus sentences to the row's end, so the language model stays what it was.
    The assistant's reply weighs `reply_weight`, every other token 1."""
    rng = random.Random(seed)
    out, weights = [], []
    for _ in range(n):
        lead = tool_chat(rng, syntax) if rng.random() < share else ""
        ids = encode(lead) if lead else []
        w = [1.0] * len(ids)
        if lead:
            start = len(lead[: lead.rindex("<|assistant|>")].split()) + 1  # the reply's first token
            w[start:] = [reply_weight] * (len(ids) - start)
        while len(ids) < length:
            ids += encode(corpus_sentence(rng))
        w += [1.0] * (len(ids) - len(w))
        out.append(ids[:length])
        weights.append(w[:length])
    return torch.tensor(out), torch.tensor(weights)


def train_skills(t: dict[str, torch.Tensor], arch, rows_: torch.Tensor, weights: torch.Tensor, steps: int, lr: float,
                 batch: int, model_logits) -> dict[str, torch.Tensor]:
    """Fine-tune every main-model weight on `rows_` with per-token loss `weights` (AdamW; the MTP layer and the
    routers' correction biases untouched), in the model's own attention (DSA as served). `model_logits(t, arch,
    ids)`: the whole-model forward (quantkit.synthetic.tiny's, passed in so that tiny imports skills, not both ways)."""
    a = arch
    mtp = tuple(a.layer_prefix(L) for L in range(a.num_hidden_layers, a.num_layers_with_mtp))
    t = {k: v.detach().clone() for k, v in t.items()}
    trainable = [v.requires_grad_() for k, v in t.items() if not k.endswith("e_score_correction_bias") and not k.startswith(mtp)]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    for step in range(steps):
        ids, w = rows_[step * batch:(step + 1) * batch], weights[step * batch:(step + 1) * batch, 1:].reshape(-1)
        logits = model_logits(t, a, ids[:, :-1])
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = (ce * w).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in t.items()}
