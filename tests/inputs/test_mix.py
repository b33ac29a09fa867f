"""quantkit.inputs.mix: a calibration set from several local sources, read by the same readers as
one `--calib` spec, interleaved in a fixed order, with per-source counts; no network."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.errors import ConfigError
from quantkit.inputs.mix import MixSourceError, interleave_order, load_mix
from quantkit.inputs.tokens import load_tokens
from quantkit.synthetic import tiny

pytestmark = pytest.mark.usefixtures("no_network")  # tests/conftest.py


def chat_and_text(tmp_path: Path) -> tuple[Path, Path]:
    """Two local sources: chat transcripts (messages) and plain documents."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": tiny.corpus(2, i)},
                                                     {"role": "assistant", "content": tiny.corpus(2, 50 + i)}]}) + "\n"
                            for i in range(20)))
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(tiny.corpus(3, 100 + i) for i in range(20)))
    return chat, text


def test_interleave_is_stratified_and_fixed():
    assert interleave_order([3, 1]) == [(0, 0), (0, 1), (1, 0), (0, 2)]
    assert interleave_order([2, 2]) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert interleave_order([4]) == [(0, j) for j in range(4)]


def test_each_source_reads_as_its_own_spec_then_interleaves(tmp_path, tiny_kimi):
    chat, text = chat_and_text(tmp_path)
    np.save(tmp_path / "ids.npy", np.arange(40 * 16).reshape(40, 16) % 100)
    sources = [(str(chat), 3), (str(text), 2), (str(tmp_path / "ids.npy"), 1)]
    d = load_mix(sources, tokenizer=tiny_kimi, seq_len=16, seed=2)
    alone = [load_tokens(s, tokenizer=tiny_kimi, num_samples=n, seq_len=16, seed=2) for s, n in sources]
    assert d.ids.shape == (6, 16) and d.ids.dtype == torch.int64
    expect = torch.stack([alone[i].ids[j] for i, j in interleave_order([3, 2, 1])])
    assert torch.equal(d.ids, expect)
    assert [(x["spec"], x["windows"], x["tokens"], x["sha256"]) for x in d.source["sources"]] == [
        (a.spec, n, n * 16, a.sha256) for a, (_, n) in zip(alone, sources)]
    assert d.source["kind"] == "mix" and d.spec.startswith("mix:file:")
    assert load_mix(sources, tokenizer=tiny_kimi, seq_len=16, seed=2).sha256 == d.sha256  # deterministic
    one = load_mix([("synthetic:train", 4)], tokenizer=None, seq_len=16)  # a mix of one source is that source
    assert torch.equal(one.ids, load_tokens("synthetic:train", tokenizer=None, num_samples=4, seq_len=16).ids)


def test_a_short_or_unknown_source_is_named(tmp_path, tiny_kimi):
    chat, _ = chat_and_text(tmp_path)
    with pytest.raises(MixSourceError, match="need 400x16") as e:
        load_mix([("synthetic:train", 1), (str(chat), 400)], tokenizer=tiny_kimi, seq_len=16)
    assert (e.value.index, e.value.spec) == (1, str(chat))
    with pytest.raises(ConfigError, match="not a file, a folder") as e:
        load_mix([("chta", 1)], tokenizer=tiny_kimi, seq_len=16)
    assert e.value.index == 0
