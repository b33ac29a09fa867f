"""quantkit.inputs.tokens: every spec kind (the Hugging Face path offline, on local dataset folders),
chat-template rendering, determinism, held-out separation, no pickle, and one-line errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.errors import ConfigError
from quantkit.inputs import tokens as calib
from quantkit.inputs.tokens import load_tokens, parse_spec
from quantkit.synthetic import tiny

BOS, EOS = 1, 2


pytestmark = pytest.mark.usefixtures("no_network")  # tests/conftest.py


def docs(n: int, seed: int = 0) -> list[str]:
    """n documents of the tiny models' language (every word is in their vocabulary)."""
    return [tiny.corpus(3, seed * 100_000 + i) for i in range(n)]


def packed(texts: list[str], n: int, L: int) -> torch.Tensor:
    stream = [t for text in texts for t in [BOS, *tiny.encode(text), EOS]]
    return torch.tensor(stream[: n * L]).view(n, L)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- synthetic ----------------------------------------------------------------------------------
def test_synthetic_train_and_heldout_are_the_tiny_corpus():
    train = load_tokens("synthetic", tokenizer=None, num_samples=4, seq_len=32)
    assert train.spec == "synthetic:train" and train.ids.dtype == torch.int64 and train.ids.shape == (4, 32)
    assert torch.equal(train.ids, tiny.batches(4, 32, 0))
    held = load_tokens("synthetic:heldout", tokenizer=None, num_samples=4, seq_len=32)
    assert torch.equal(held.ids, tiny.batches(4, 32, calib.HELDOUT_SEED))
    assert held.sha256 != train.sha256 and held.source["corpus_seed"] >= 1000
    assert train.sha256 == hashlib.sha256(train.ids.numpy().tobytes()).hexdigest()


def test_synthetic_seed_determinism_and_heldout_boundary():
    a = load_tokens("synthetic:train", tokenizer=None, num_samples=2, seq_len=16, seed=5)
    assert a.sha256 == load_tokens("synthetic:train", tokenizer=None, num_samples=2, seq_len=16, seed=5).sha256
    assert a.sha256 != load_tokens("synthetic:train", tokenizer=None, num_samples=2, seq_len=16, seed=6).sha256
    with pytest.raises(ConfigError, match="held-out"):
        load_tokens("synthetic:train", tokenizer=None, num_samples=64, seq_len=64, seed=995)
    with pytest.raises(ConfigError, match="synthetic:train or synthetic:heldout"):
        load_tokens("synthetic:test", tokenizer=None, num_samples=2, seq_len=16)


# ---- local text files ---------------------------------------------------------------------------
def test_jsonl_text_packs_documents_with_bos_eos(tmp_path, tiny_kimi):
    texts = docs(1)
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": texts[0]}])
    L = len(tiny.encode(texts[0])) + 2
    d = load_tokens(str(f), tokenizer=tiny_kimi, num_samples=1, seq_len=L)
    assert torch.equal(d.ids, packed(texts, 1, L))
    assert d.spec == f"file:{f.resolve()}"
    assert d.source["kind"] == "file" and d.source["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()


def test_chat_messages_use_the_chat_template(tmp_path, tiny_kimi):
    chat = [{"role": "user", "content": "what does ada have ?"}, {"role": "assistant", "content": "a cat ."}]
    sharegpt = [{"from": "human", "value": "what does ada have ?"}, {"from": "gpt", "value": "a cat ."}]
    rendered = tiny.encode("<|user|> what does ada have ? <|assistant|> a cat .")
    for row in ({"messages": chat}, {"conversations": sharegpt}):
        f = write_jsonl(tmp_path / "chat.jsonl", [row])
        d = load_tokens(str(f), tokenizer=tiny_kimi, num_samples=1, seq_len=len(rendered) + 2)
        assert d.ids[0].tolist() == [BOS, *rendered, EOS]
    joined = tiny.encode("what does ada have ? a cat .")
    plain = load_tokens(str(f), tokenizer=tiny_kimi, num_samples=1, seq_len=len(joined) + 2, chat_template=False)
    assert plain.ids[0].tolist() == [BOS, *joined, EOS]


def test_txt_documents_are_separated_by_blank_lines(tmp_path, tiny_kimi):
    texts = docs(6)
    f = tmp_path / "c.txt"
    f.write_text("\n\n".join(texts) + "\n")
    d = load_tokens(str(f), tokenizer=tiny_kimi, num_samples=2, seq_len=16)
    # every window is a slice of some shuffled order of the six documents
    starts = [packed([t], 1, 16)[0].tolist() for t in texts]
    assert d.ids[0].tolist() in starts
    assert d.source["format"] == "txt" and d.source["documents"] >= 1


def test_parquet_text_and_messages_columns(tmp_path, tiny_kimi):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = docs(8)
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet")
    d = load_tokens(str(tmp_path / "t.parquet"), tokenizer=tiny_kimi, num_samples=4, seq_len=16)
    assert d.ids.shape == (4, 16) and d.source["format"] == "parquet"
    msgs = [[{"role": "user", "content": t}] for t in texts]
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "m.parquet")
    m = load_tokens(str(tmp_path / "m.parquet"), tokenizer=tiny_kimi, num_samples=4, seq_len=16)
    assert (m.ids == tiny.encode("<|user|>")[0]).any()


def test_text_determinism_and_seed(tmp_path, tiny_kimi):
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in docs(40)])
    kw = dict(tokenizer=tiny_kimi, num_samples=4, seq_len=32)
    a, b, c = (load_tokens(str(f), seed=s, **kw) for s in (0, 0, 1))
    assert a.sha256 == b.sha256 and torch.equal(a.ids, b.ids)
    assert a.sha256 != c.sha256


def test_too_few_tokens_says_how_many(tmp_path, tiny_kimi):
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat sees the dog ."}] * 3)  # 3 x (6 + 2) tokens
    with pytest.raises(ConfigError, match=r"only 24 tokens in 3 documents, need 10x8 = 80; lower num_samples or seq_len"):
        load_tokens(str(f), tokenizer=tiny_kimi, num_samples=10, seq_len=8)


def test_bad_files_give_one_line_errors(tmp_path, tiny_kimi):
    kw = dict(tokenizer=tiny_kimi, num_samples=1, seq_len=4)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{not json\n')
    cases = {
        str(bad): f"{bad.resolve()}:2: not valid JSON",
        str(write_jsonl(tmp_path / "nofield.jsonl", [{"prompt": "x"}])): r'no "text" string or "messages"',
        str(tmp_path / "missing.jsonl"): "file not found",
        "just-a-word": "not a file, a folder",
    }
    (tmp_path / "c.csv").write_text("a,b\n")
    cases[str(tmp_path / "c.csv")] = "unsupported file type '.csv'"
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message) as e:
            load_tokens(spec, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        load_tokens(str(bad), tokenizer=None, num_samples=1, seq_len=4)


def test_tokenizer_remote_code_only_when_asked(tmp_path, tiny_kimi, monkeypatch):
    from transformers import AutoTokenizer

    seen = []
    real = AutoTokenizer.from_pretrained

    def spy(folder, **kwargs):
        seen.append(kwargs)
        return real(folder, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    calib._load_tokenizer.cache_clear()
    f = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in docs(4)])
    load_tokens(str(f), tokenizer=tiny_kimi, num_samples=1, seq_len=8)
    load_tokens(str(f), tokenizer=tiny_kimi, num_samples=1, seq_len=8, trust_remote_code=True)
    calib._load_tokenizer.cache_clear()
    assert [k["trust_remote_code"] for k in seen] == [False, True]
    assert all(k["local_files_only"] for k in seen)


# ---- pre-tokenized files ------------------------------------------------------------------------
def test_npy_rows_and_stream(tmp_path):
    rows = np.arange(6 * 8, dtype=np.int32).reshape(6, 8)
    np.save(tmp_path / "r.npy", rows)
    d = load_tokens(str(tmp_path / "r.npy"), tokenizer=None, num_samples=4, seq_len=8, seed=3)
    assert d.ids.dtype == torch.int64 and d.ids.shape == (4, 8)
    assert {tuple(r) for r in d.ids.tolist()} <= {tuple(r) for r in rows.tolist()}
    assert d.sha256 != load_tokens(str(tmp_path / "r.npy"), tokenizer=None, num_samples=4, seq_len=8, seed=4).sha256
    np.save(tmp_path / "s.npy", np.arange(100))  # 1-D stream: 12 windows of 8
    s = load_tokens(str(tmp_path / "s.npy"), tokenizer=None, num_samples=12, seq_len=8)
    assert sorted(s.ids[:, 0].tolist()) == list(range(0, 96, 8))
    with pytest.raises(ConfigError, match="100 tokens make 7 windows of 14, need 8"):
        load_tokens(str(tmp_path / "s.npy"), tokenizer=None, num_samples=8, seq_len=14)


def test_npy_never_unpickles(tmp_path, monkeypatch):
    np.save(tmp_path / "o.npy", np.array([[1, 2], [3, 4]], dtype=object), allow_pickle=True)
    calls = []
    real = np.load
    monkeypatch.setattr(np, "load", lambda *a, **k: calls.append(k) or real(*a, **k))
    with pytest.raises(ConfigError, match="pickle"):
        load_tokens(str(tmp_path / "o.npy"), tokenizer=None, num_samples=1, seq_len=2)
    assert calls == [{"allow_pickle": False}]
    np.save(tmp_path / "f.npy", np.zeros((2, 4), dtype=np.float32))
    with pytest.raises(ConfigError, match="not an integer type"):
        load_tokens(str(tmp_path / "f.npy"), tokenizer=None, num_samples=1, seq_len=4)


def test_safetensors_input_ids_and_vocab_check(tmp_path, tiny_kimi):
    from safetensors.torch import save_file

    ids = torch.randint(0, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, str(tmp_path / "t.safetensors"))
    d = load_tokens(str(tmp_path / "t.safetensors"), tokenizer=tiny_kimi, num_samples=3, seq_len=16)
    assert sorted(map(tuple, d.ids.tolist())) == sorted(map(tuple, ids.tolist()))
    save_file({"tokens": ids}, str(tmp_path / "k.safetensors"))
    with pytest.raises(ConfigError, match="no `input_ids` tensor .has: tokens."):
        load_tokens(str(tmp_path / "k.safetensors"), tokenizer=None, num_samples=1, seq_len=16)
    np.save(tmp_path / "big.npy", np.full((1, 4), 600))
    with pytest.raises(ConfigError, match="token id 600 >= the model's vocab_size 512"):
        load_tokens(str(tmp_path / "big.npy"), tokenizer=tiny_kimi, num_samples=1, seq_len=4)


# ---- Hugging Face datasets (offline: local dataset folders) -------------------------------------
def test_hf_spec_grammar():
    s = parse_spec("HuggingFaceH4/ultrachat_200k@train_sft")
    assert (s.kind, s.normalized, s.dataset, s.split, s.config) == (
        "hf", "hf:HuggingFaceH4/ultrachat_200k@train_sft", "HuggingFaceH4/ultrachat_200k", "train_sft", None)
    s = parse_spec("hf:org/name:cfg@test#abc123")
    assert (s.dataset, s.config, s.split, s.revision) == ("org/name", "cfg", "test", "abc123")
    assert parse_spec("hf:org/name").normalized == "hf:org/name@train"


def test_hf_parquet_folder_streams_offline(tmp_path, tiny_kimi):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "ds" / "data"
    folder.mkdir(parents=True)
    texts = docs(30)
    pq.write_table(pa.table({"text": texts[:15]}), folder / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"text": texts[15:]}), folder / "train-00001-of-00002.parquet")
    kw = dict(tokenizer=tiny_kimi, num_samples=4, seq_len=16)
    d = load_tokens(f"hf:{tmp_path / 'ds'}@train", **kw)
    assert d.spec == f"hf:{(tmp_path / 'ds').resolve()}@train"
    assert d.source["kind"] == "hf" and d.source["split"] == "train" and d.source["local"]
    assert d.sha256 == load_tokens(str(tmp_path / "ds"), **kw).sha256  # a plain folder is the same spec
    assert d.sha256 != load_tokens(f"hf:{tmp_path / 'ds'}", seed=1, **kw).sha256
    with pytest.raises(ConfigError, match="cannot load the dataset .ValueError: Bad split"):
        load_tokens(f"hf:{tmp_path / 'ds'}@nope", **kw)


def test_hf_saved_dataset_dict_with_chat_split(tmp_path, tiny_kimi):
    import datasets

    chats = [[{"role": "user", "content": t}, {"role": "assistant", "content": "a cat ."}] for t in docs(10)]
    datasets.DatasetDict({
        "train_sft": datasets.Dataset.from_dict({"messages": chats}),
        "test_sft": datasets.Dataset.from_dict({"messages": chats[:5]}),
    }).save_to_disk(str(tmp_path / "uc"))
    d = load_tokens(f"hf:{tmp_path / 'uc'}@test_sft", tokenizer=tiny_kimi, num_samples=2, seq_len=16)
    assert d.ids[0, :2].tolist() == [BOS, tiny.encode("<|user|>")[0]]
    with pytest.raises(ConfigError, match="no split 'validation' .has: train_sft, test_sft."):
        load_tokens(f"hf:{tmp_path / 'uc'}@validation", tokenizer=tiny_kimi, num_samples=2, seq_len=16)


def test_hf_hub_id_calls_load_dataset_streaming(tmp_path, tiny_kimi, monkeypatch):
    """A Hub id goes to datasets.load_dataset(name, config, split, revision, streaming=True); faked here."""
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, **kwargs):
        calls.append((name, config, kwargs))
        return iter([{"text": t} for t in docs(20)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    d = load_tokens("org/chat:default@train_sft#0123abc", tokenizer=tiny_kimi, num_samples=2, seq_len=16)
    assert calls == [("org/chat", "default", {"split": "train_sft", "revision": "0123abc", "streaming": True})]
    assert d.source == {"kind": "hf", "dataset": "org/chat", "config": "default", "split": "train_sft",
                        "revision": "0123abc", "local": False, "documents": d.source["documents"], "chat_template": True}


def test_buffer_shuffle_is_a_seeded_permutation():
    import random

    out = list(calib._buffer_shuffle(iter(range(50)), 8, random.Random(0)))
    assert sorted(out) == list(range(50)) and out != list(range(50))
    assert out == list(calib._buffer_shuffle(iter(range(50)), 8, random.Random(0)))


# ---- not text: binary junk, wrong encodings -----------------------------------------------------------------
def test_binary_junk_is_refused_with_the_fraction_found(tmp_path, tiny_kimi):
    """300 KB of random bytes in a .txt used to calibrate with exit 0 (most experts starved)."""
    junk = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    kw = dict(tokenizer=tiny_kimi, num_samples=2, seq_len=16)
    for name in ("junk.txt", "junk.jsonl"):
        f = tmp_path / name
        high = bytes(b | 0x80 for b in junk)  # no quote, backslash or control byte: valid JSON around it
        f.write_bytes(junk if name.endswith(".txt") else b'{"text": "' + high + b'"}\n')
        with pytest.raises(ConfigError, match=r"\d+\.\d% of its [\d,]+ bytes are not valid UTF-8 .*re-encode it") as e:
            load_tokens(str(f), **kw)
        assert "\n" not in str(e.value) and str(f.resolve()) in str(e.value)


def test_text_of_mostly_unknown_tokens_is_refused(tmp_path, tiny_kimi):
    """Valid UTF-8, but words the tokenizer does not know: the fraction is named."""
    f = tmp_path / "other.txt"
    f.write_text("\n\n".join("Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich." for _ in range(20)))
    with pytest.raises(ConfigError, match=r"\d+\.\d% of its first 32 tokens are the tokenizer's unknown token '<unk>'"):
        load_tokens(str(f), tokenizer=tiny_kimi, num_samples=2, seq_len=16)


def test_real_text_with_a_stray_byte_still_works(tmp_path, tiny_kimi):
    texts = docs(6)
    f = tmp_path / "c.txt"
    f.write_bytes(("\n\n".join(texts)).encode() + b"\n\n\xff\n")  # one non-UTF-8 byte: replaced, not refused
    d = load_tokens(str(f), tokenizer=tiny_kimi, num_samples=2, seq_len=16)
    assert d.ids.shape == (2, 16)
    assert float((d.ids == 3).float().mean()) < 0.1  # <unk> is id 3 in the tiny vocabulary


def test_probe_ids_avoid_every_calibration_id_and_are_seeded():
    """quantkit.inputs.tokens.probe_ids: ids the calibration never contains, the calibration's window
    length, the same for the same seed; every id when the calibration has them all."""
    cal = load_tokens("synthetic:train", tokenizer=None, num_samples=8, seq_len=32).ids
    p = calib.probe_ids(cal, 512, 3, seed=0)
    assert p.shape == (3, 32) and p.dtype == torch.int64
    assert not set(p.flatten().tolist()) & set(cal.flatten().tolist())
    assert p.max() < 512 and len(set(p.flatten().tolist())) > 40
    assert torch.equal(p, calib.probe_ids(cal, 512, 3, seed=0)) and not torch.equal(p, calib.probe_ids(cal, 512, 3, seed=1))
    full = torch.arange(16).reshape(2, 8)
    assert set(calib.probe_ids(full, 16, 4, seed=0).flatten().tolist()) <= set(range(16))


def test_random_spec_draws_the_embedding_less_special_tokens(tmp_path, tiny_kimi):
    """`random`: uniform ids over [0, vocab_size) less the tokenizer's special and added tokens, seeded;
    the pool is the embedding, not the tokenizer (the tiny tokenizer is shorter than its 512 rows)."""
    from quantkit.inputs.tokens import open_tokenizer

    tok = open_tokenizer(tiny_kimi)
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    d = load_tokens("random", tokenizer=tiny_kimi, num_samples=16, seq_len=64)
    ids = set(d.ids.flatten().tolist())
    assert d.ids.shape == (16, 64) and d.ids.dtype == torch.int64 and d.spec == "random"
    assert special and not ids & special
    assert max(ids) < 512 and max(ids) >= len(tok)  # rows past the tokenizer's length are drawn too
    assert len(ids) > 350  # 1024 uniform draws from ~500 ids reach ~440 of them
    assert d.source == {"kind": "random", "vocab_size": 512, "pool": 512 - len(special), "excluded": len(special)}
    again = load_tokens("random", tokenizer=tiny_kimi, num_samples=16, seq_len=64)
    assert again.sha256 == d.sha256
    assert load_tokens("random", tokenizer=tiny_kimi, num_samples=16, seq_len=64, seed=1).sha256 != d.sha256
    with pytest.raises(ConfigError, match="need the model folder"):
        load_tokens("random", tokenizer=None, num_samples=1, seq_len=4)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"m/config.json: no vocab_size"):
        load_tokens("random", tokenizer=folder, num_samples=1, seq_len=4)


def test_random_spec_reads_special_tokens_from_the_json_files_alone(tmp_path):
    """The shapes the real models store their special tokens in, with no tokenizer code run: Kimi's
    tiktoken folder (tokenizer_config.json's added_tokens_decoder, no tokenizer.json), GLM's
    tokenizer.json added_tokens, config.json's eos list."""
    folder = tmp_path / "kimi-like"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 64, "eos_token_id": [7, 9]}}))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(i): {"content": f"<|reserved_{i}|>", "special": True} for i in range(56, 64)},
         "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    (folder / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": 0, "content": "[gMASK]"}], "model": {"vocab": {"<s>": 1}}}))
    d = load_tokens("random", tokenizer=folder, num_samples=64, seq_len=32)
    assert set(d.ids.flatten().tolist()) == set(range(64)) - {0, 7, 9, *range(56, 64)}
    assert d.source["excluded"] == 11


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"], ids=["bom", "le-no-bom", "be-no-bom"])
def test_utf16_text_is_refused_naming_its_encoding(tmp_path, tiny_kimi, encoding):
    """UTF-16 is valid UTF-8 byte for byte where it is ASCII (a NUL after each letter): it read as a
    handful of tokens and was refused as "only N tokens" instead of by its encoding. With a byte-order
    mark or without one."""
    f = tmp_path / "utf16.txt"
    f.write_bytes("\n\n".join(docs(40)).encode(encoding))
    with pytest.raises(ConfigError, match=r"UTF-16.*iconv -f utf-16 -t utf-8") as e:
        load_tokens(str(f), tokenizer=tiny_kimi, num_samples=2, seq_len=16)
    assert "\n" not in str(e.value) and "only" not in str(e.value)


def test_a_long_document_prints_no_tokenizer_length_warning(tmp_path, tiny_kimi):
    """A document longer than the tokenizer's model_max_length is fine for calibration (it is packed
    into windows); transformers' "Token indices sequence length is longer than ..." is noise there.
    In a fresh process: transformers warns once per tokenizer object, through its own handler."""
    import subprocess
    import sys

    f = tmp_path / "long.txt"
    f.write_text(" ".join(docs(800)))  # one document, over 4096 tokens
    code = ("from quantkit.inputs.tokens import load_tokens; "
            f"load_tokens({str(f)!r}, tokenizer={str(tiny_kimi)!r}, num_samples=2, seq_len=16)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "Token indices sequence length" not in run.stderr + run.stdout


def test_reads_text_only_for_text_and_datasets(tmp_path):
    """What the planner adds the tokenizer's memory for: text files and datasets, not ids."""
    from quantkit.inputs.tokens import reads_text

    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.npy").write_bytes(b"")
    assert reads_text(str(tmp_path / "a.jsonl")) and reads_text("hf:org/name@train") and reads_text(str(tmp_path))
    assert not any(reads_text(s) for s in ("synthetic:train", "random", str(tmp_path / "a.npy")))
    with pytest.raises(ConfigError, match="missing.txt: file not found"):  # as convert refuses it
        reads_text(str(tmp_path / "missing.txt"))
