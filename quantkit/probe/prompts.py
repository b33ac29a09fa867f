"""The probe's prompt set: shipped in the package (prompts.json), hashed into every result, so two
probes are comparable exactly when their `prompt_set.sha256` agree; and the token ids each prompt
becomes under the pair's own tokenizer and chat template (what the server should compute on)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from quantkit.errors import ConfigError


@dataclass
class Prompt:
    id: str
    kind: str  # "completion" (POST /v1/completions) or "chat" (POST /v1/chat/completions)
    body: str | list[dict]  # the prompt text, or the chat messages
    ids: list[int]  # the token ids under the pair's tokenizer (chat: with the template and generation prompt)


@dataclass
class PromptSet:
    name: str
    sha256: str
    max_tokens: int
    top_logprobs: int
    prompts: list[Prompt]


@dataclass
class PromptFile:
    """A prompt set as read from its file, not yet tokenized: checked before the endpoint is asked, and
    before transformers (seconds to import) is needed."""

    where: str
    raw: bytes
    data: dict


def read_prompt_set(path: Path | None = None) -> PromptFile:
    """The recorded prompts (the shipped prompts.json unless `path`), parsed and checked; one line on bad input."""
    if path is not None and not path.is_file():
        raise ConfigError(f"{path}: no such prompt set; pass a JSON file like quantkit/probe/prompts.json")
    raw = path.read_bytes() if path else resources.files("quantkit.probe").joinpath("prompts.json").read_bytes()
    where = str(path or "quantkit/probe/prompts.json")
    try:
        d = json.loads(raw)
        items = d["prompts"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{where}: not a prompt set ({e}); it needs a `prompts` list") from None
    for p in items:
        if p.get("kind") not in ("chat", "completion"):
            raise ConfigError(f"{where}: prompt {p.get('id')!r} has kind {p.get('kind')!r}; use completion or chat")
    return PromptFile(where, raw, d)


def load_tokenizer(tokenizer_dir: Path):
    """The pair's tokenizer; one line naming the folder when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{tokenizer_dir}: no tokenizer the probe can use ({str(e).splitlines()[0]}); "
                          "the pair's folders need tokenizer.json/tokenizer_config.json") from None


def tokenize_prompt_set(f: PromptFile, tok) -> PromptSet:
    """Each prompt's token ids under the pair's tokenizer `tok` (chat: its template, with the generation prompt)."""
    prompts = []
    for p in f.data["prompts"]:
        if p["kind"] == "chat":
            enc = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
            ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
            prompts.append(Prompt(p["id"], "chat", p["messages"], ids))
        else:
            prompts.append(Prompt(p["id"], "completion", p["prompt"], tok.encode(p["prompt"])))
    d = f.data
    return PromptSet(d.get("name", f.where), hashlib.sha256(f.raw).hexdigest(), int(d.get("max_tokens", 16)),
                     int(d.get("top_logprobs", 5)), prompts)


def load_prompt_set(tokenizer_dir: Path, path: Path | None = None) -> PromptSet:
    """The recorded prompts (the shipped prompts.json unless `path`), tokenized by `tokenizer_dir`'s tokenizer."""
    return tokenize_prompt_set(read_prompt_set(path), load_tokenizer(tokenizer_dir))
