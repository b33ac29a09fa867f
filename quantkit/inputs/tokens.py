"""Calibration and evaluation tokens: one function from a data spec to an int64 [N, L] tensor.

GPTQ needs activations that look like what the model will serve (Hessians are sums of x x^T over
calibration tokens), and validation needs tokens the calibration never saw. Both come from here:

    load_tokens("hf:HuggingFaceH4/ultrachat_200k@train_sft", tokenizer=folder, num_samples=512, seq_len=2048)
    load_tokens("synthetic:heldout", tokenizer=None, num_samples=8, seq_len=64)

Spec grammar (docs/recipes.md has the full reference):

    synthetic[:train|:heldout]          the tiny models' generated corpus (quantkit.synthetic.tiny); train draws
                                        corpus seeds in [0, 1000), heldout seeds >= 1000
    random                              uniform token ids over the model's vocabulary, its special tokens
                                        excepted: a data-free share of a calibration mix that reaches
                                        every token's directions (`_random`)
    PATH.jsonl | .txt | .parquet        text or chat documents in a local file
    PATH.npy | .safetensors             pre-tokenized ids (int [N, L] or a 1-D stream; `input_ids`)
    DIR                                 a local dataset folder (parquet/json files, or save_to_disk)
    hf:ID[:CONFIG][@SPLIT][#REVISION]   a dataset loaded with datasets.load_dataset (streamed);
                                        ID is a Hub id or a local dataset folder
    ORG/NAME[:CONFIG][@SPLIT][#REV]     the same, when ORG/NAME is not a local path

Text documents are rendered (chat `messages` through the tokenizer's chat template), tokenized,
shuffled with a seeded RNG, joined with BOS/EOS separators and cut into N consecutive windows of L
tokens. Pre-tokenized files are joined as they are and N of their L-token windows are drawn with
the seeded RNG. The same spec, tokenizer, sizes and seed always give the same ids (and sha256).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

import torch

from quantkit.errors import ConfigError
from quantkit.inputs.documents import document, render
from quantkit.runtime.files import file_sha256

__all__ = ["TokenData", "load_tokens", "parse_spec", "probe_ids", "HELDOUT_SEED"]

PROBE_SEED = 7919  # probe_ids' generator: the calibration seed plus this
RANDOM_SEED = 6007  # the `random` spec's generator: the calibration seed plus this (not the probe's draw)
HELDOUT_SEED = 1000  # quantkit.synthetic.tiny: corpus seeds >= 1000 never reach training or calibration
TEXT_SUFFIXES = (".jsonl", ".txt", ".parquet")
TOKEN_SUFFIXES = (".npy", ".safetensors")
SHUFFLE_BUFFER = 10_000  # documents held when shuffling a streamed dataset
_TOKENIZE_BATCH = 64
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?(@[\w.-]+)?(#[\w.-]+)?$")


@dataclass
class TokenData:
    ids: torch.Tensor  # int64 [N, L]
    spec: str  # what was asked for, normalized
    sha256: str  # of ids' bytes (int64, row-major): the data identity in reports
    source: dict  # where the tokens came from, e.g. {"kind": "hf", "dataset": ..., "split": ...}


@dataclass(frozen=True)
class Spec:
    """A parsed data spec. kind: synthetic | random | text | tokens | hf (a local folder is hf with local=True)."""

    kind: str
    normalized: str
    path: Path | None = None  # text/tokens files, local dataset folders
    split: str | None = None
    dataset: str | None = None  # hf id or folder
    config: str | None = None
    revision: str | None = None


def parse_spec(spec: str) -> Spec:
    """Parse a data spec (no data is read; a local path must exist to count as one)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("data spec is empty; use synthetic:train, a .jsonl/.txt/.parquet/.npy/.safetensors file, "
                          "or hf:org/name@split")
    s = spec.strip()
    if s == "synthetic" or s.startswith("synthetic:"):
        split = s.partition(":")[2] or "train"
        if split not in ("train", "heldout"):
            raise ConfigError(f"{s}: unknown synthetic split {split!r}; use synthetic:train or synthetic:heldout")
        return Spec("synthetic", f"synthetic:{split}", split=split)
    if s == "random":
        return Spec("random", "random")
    if s.startswith("hf:"):
        return _parse_hf(s[3:], s)
    path = Path(s).expanduser()
    suffix = path.suffix.lower()
    if path.is_dir():  # a local dataset folder, split "train" (write hf:DIR@split for another)
        folder = path.resolve()
        return Spec("hf", f"hf:{folder}@train", path=folder, dataset=str(folder), split="train")
    if suffix in TEXT_SUFFIXES + TOKEN_SUFFIXES:
        if not path.is_file():
            raise ConfigError(f"{s}: file not found; check the path (relative paths start at the current folder)")
        return Spec("text" if suffix in TEXT_SUFFIXES else "tokens", f"file:{path.resolve()}", path=path.resolve())
    if path.exists():
        raise ConfigError(f"{s}: unsupported file type {suffix or '(none)'!r}; "
                          "use .jsonl, .txt, .parquet (text) or .npy, .safetensors (token ids)")
    if _HF_ID.match(s):
        return _parse_hf(s, s)
    raise ConfigError(
        f"{s}: not a file, a folder, synthetic[:train|:heldout] or a dataset id; write hf:org/name[:config][@split]")


def _parse_hf(body: str, original: str) -> Spec:
    body, _, revision = body.partition("#")
    body, _, split = body.rpartition("@") if "@" in body else (body, "", "")
    head, slash, tail = body.rpartition("/")
    name, _, config = tail.partition(":")
    dataset = head + slash + name
    if not name:
        raise ConfigError(f"{original}: no dataset name; write hf:org/name[:config][@split]")
    split = split or "train"
    local = Path(dataset).expanduser()
    if local.is_dir():
        dataset = str(local.resolve())
    norm = f"hf:{dataset}" + (f":{config}" if config else "") + f"@{split}" + (f"#{revision}" if revision else "")
    return Spec("hf", norm, path=local.resolve() if local.is_dir() else None, dataset=dataset,
                config=config or None, split=split, revision=revision or None)


def reads_text(spec: str) -> bool:
    """Whether loading `spec` tokenizes text (a text file or a dataset: transformers and a fast tokenizer
    are imported, about 0.25 GB of the process's memory, quantkit.planner.budgets.TOKENIZER_BYTES).
    A spec that does not parse (a missing file) raises parse_spec's one-line ConfigError, so `plan
    --convert --calib` refuses what convert would."""
    return parse_spec(spec).kind in ("text", "hf")


def load_tokens(
    spec: str,
    *,
    tokenizer: Path | None,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    trust_remote_code: bool = False,
    chat_template: bool = True,
) -> TokenData:
    """Load `num_samples` windows of `seq_len` token ids for `spec`.

    Args:
        spec: a data spec (module docstring).
        tokenizer: the model folder whose tokenizer renders and tokenizes text (not needed for
            synthetic data or pre-tokenized files).
        seed: shuffles documents (text) or picks windows (token files, synthetic corpus seed).
        trust_remote_code: allow a tokenizer that ships its own Python code (Kimi's tiktoken one).
        chat_template: render chat `messages` with the tokenizer's template; False joins the
            message contents with newlines.
    Returns:
        TokenData with ids int64 [num_samples, seq_len].
    Raises:
        ConfigError: bad spec, unreadable file, missing tokenizer, or too few tokens.
    """
    for field, value in (("num_samples", num_samples), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{spec}: {field} must be a positive integer (got {value!r})")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"{spec}: seed must be a non-negative integer (got {seed!r})")
    s = parse_spec(spec)
    if s.kind == "synthetic":
        ids, source = _synthetic(s, num_samples, seq_len, seed)
    elif s.kind == "random":
        ids, source = _random(tokenizer, num_samples, seq_len, seed)
    elif s.kind == "tokens":
        ids, source = _token_file(s, num_samples, seq_len, seed)
    else:
        tok = _tokenizer(tokenizer, trust_remote_code, s.normalized)
        docs, source = (_text_file(s) if s.kind == "text" else _hf_documents(s, seed))
        if s.kind == "text":
            random.Random(seed).shuffle(docs)
        texts = (t for t in (render(d, tok, chat_template, s.normalized) for d in docs) if t)
        ids, used = _pack(_tokenize(tok, texts), tok, num_samples, seq_len, s.normalized)
        _check_known(ids, tok, s.normalized)
        source.update(documents=used, chat_template=chat_template)
    ids = ids.to(torch.int64).contiguous()
    if tokenizer is not None:
        _check_vocab(ids, Path(tokenizer), s.normalized)
    return TokenData(ids=ids, spec=s.normalized, sha256=hashlib.sha256(ids.numpy().tobytes()).hexdigest(), source=source)


def probe_ids(calibration: torch.Tensor, vocab_size: int, num_samples: int, seed: int = 0) -> torch.Tensor:
    """Probe windows, int64 [num_samples, L] with L the calibration's window length: token ids drawn
    uniformly (seeded) from the vocabulary ids the calibration (N, L) never contains, so that the
    layers see inputs outside its span (quantkit.quant.experts, "Probe"). Every id when the
    calibration contains them all. Not text: a stress input, like a user's code, tool calls or
    another script arriving as ids chat never produced."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    seen[calibration.flatten().clamp(0, vocab_size - 1)] = True
    pool = (~seen).nonzero().flatten()
    if len(pool) == 0:
        pool = torch.arange(vocab_size)
    gen = torch.Generator().manual_seed(PROBE_SEED + seed)
    pick = torch.randint(0, len(pool), (num_samples, calibration.shape[1]), generator=gen)
    return pool[pick].to(torch.int64)  # (num_samples, L)


# ---- synthetic corpus ----------------------------------------------------------------------------
def _synthetic(s: Spec, n: int, L: int, seed: int) -> tuple[torch.Tensor, dict]:
    from quantkit.synthetic import tiny

    # tiny.token_stream uses consecutive corpus seeds; each yields at least 64 sentences of >= 6 tokens.
    seeds_used = math.ceil(n * L / (64 * 6 + 1))
    if s.split == "train":
        first = seed
        if first + seeds_used > HELDOUT_SEED:
            raise ConfigError(
                f"synthetic:train: seed {seed} with {n}x{L} tokens may reach held-out corpus seeds >= {HELDOUT_SEED}; "
                f"use a seed below {max(HELDOUT_SEED - seeds_used, 0)} or fewer tokens")
    else:
        first = HELDOUT_SEED + seed
    ids = tiny.batches(n, L, first)
    return ids, {"kind": "synthetic", "split": s.split, "corpus_seed": first, "tiny_version": tiny.TINY_VERSION}


# ---- random ids ----------------------------------------------------------------------------------
def _random(folder: Path | None, n: int, L: int, seed: int) -> tuple[torch.Tensor, dict]:
    """Uniform ids over [0, vocab_size) less the model's special tokens (`_special_ids`: BOS, EOS, chat
    and tool-call markers, tokens that steer the model rather than carry text), seeded.

    Why: a Hessian only knows the directions its calibration tokens excite. Chat text never uses most
    of a vocabulary (code, other scripts, tool-call syntax), so GPTQ moves error into the directions
    those tokens excite, and no held-out chat token can see it. A share of windows of every id puts
    each token's embedding direction into every layer's Hessian without asking the user for data
    (docs/recipes.md, "The random share"). The pool is the model's embedding rows, not the
    tokenizer's length: a vocabulary padded past the tokenizer adds a few untrained rows (GLM 5.2:
    ~0.1% of the pool), a tokenizer shorter than the embedding (the test models) would hide most."""
    if folder is None:
        raise ConfigError("random: uniform ids need the model folder (its config's vocab_size); pass it as tokenizer")
    cfg, vocab = _vocab_size(Path(folder))
    if not vocab:
        raise ConfigError(f"{Path(folder) / 'config.json'}: no vocab_size; random calibration ids need the model's "
                          "vocabulary size")
    special = _special_ids(Path(folder), cfg)
    keep = torch.ones(int(vocab), dtype=torch.bool)
    keep[[i for i in special if 0 <= i < vocab]] = False
    pool = keep.nonzero().flatten()  # (P,)
    gen = torch.Generator().manual_seed(RANDOM_SEED + seed)
    ids = pool[torch.randint(0, len(pool), (n, L), generator=gen)]  # (n, L)
    return ids, {"kind": "random", "vocab_size": int(vocab), "pool": len(pool), "excluded": int(vocab) - len(pool)}


def _special_ids(folder: Path, cfg: dict) -> set[int]:
    """The special token ids a model folder names, read from its JSON files alone (no tokenizer code,
    so Kimi's tiktoken tokenizer needs no trust_remote_code here): tokenizer_config.json's
    added_tokens_decoder and named special tokens, tokenizer.json's added_tokens, and config.json's
    bos/eos/pad ids. A named token is looked up in tokenizer.json's vocabulary."""
    def read(name: str) -> dict:
        f = folder / name
        return json.loads(f.read_text()) if f.is_file() else {}

    tcfg, tj = read("tokenizer_config.json"), read("tokenizer.json")
    ids = {int(k) for k in tcfg.get("added_tokens_decoder") or {}}
    added = {a["content"]: a["id"] for a in tj.get("added_tokens") or []}
    ids |= set(added.values())
    vocab = {**((tj.get("model") or {}).get("vocab") or {}), **added}
    named = [tcfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                                   "mask_token")] + list(tcfg.get("additional_special_tokens") or [])
    for t in named:
        t = t.get("content") if isinstance(t, dict) else t
        if isinstance(t, str) and isinstance(vocab, dict) and t in vocab:
            ids.add(int(vocab[t]))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(key, (cfg.get("text_config") or {}).get(key))
        ids |= {int(x) for x in (v if isinstance(v, list) else [v]) if isinstance(x, int)}
    return ids


# ---- pre-tokenized files -------------------------------------------------------------------------
def _token_file(s: Spec, n: int, L: int, seed: int) -> tuple[torch.Tensor, dict]:
    path = s.path
    if path.suffix.lower() == ".npy":
        import numpy as np

        try:
            arr = np.load(path, allow_pickle=False)
        except ValueError as e:  # object arrays need pickle, which we never allow
            raise ConfigError(f"{path}: cannot load without pickle ({e}); save a plain integer array with np.save") from None
        except OSError as e:
            raise ConfigError(f"{path}: not a readable .npy file ({e}); save the ids with np.save") from None
        if arr.dtype.kind not in "iu":
            raise ConfigError(f"{path}: dtype {arr.dtype} is not an integer type; save token ids as int32/int64")
        ids = torch.from_numpy(arr.astype(np.int64))
    else:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                if "input_ids" not in f.keys():
                    raise ConfigError(f"{path}: no `input_ids` tensor (has: {', '.join(sorted(f.keys())) or 'none'}); "
                                      "save the ids under the name input_ids")
                ids = f.get_tensor("input_ids")
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{path}: not a readable safetensors file ({e})") from None
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ConfigError(f"{path}: input_ids has dtype {ids.dtype}; save token ids as an integer tensor")
    if ids.dim() not in (1, 2):
        raise ConfigError(f"{path}: token ids have shape {tuple(ids.shape)}; expected [N, L] or a 1-D stream")
    if ids.numel() and int(ids.min()) < 0:
        raise ConfigError(f"{path}: negative token id {int(ids.min())}; remove padding markers like -100 before saving")
    stream = ids.to(torch.int64).reshape(-1)
    windows = stream.numel() // L
    if windows < n:
        raise ConfigError(
            f"{path}: {stream.numel()} tokens make {windows} windows of {L}, need {n}; "
            f"lower num_samples or seq_len, or save more tokens")
    pick = torch.tensor(random.Random(seed).sample(range(windows), n))
    out = stream[: windows * L].view(windows, L)[pick]
    return out, {"kind": "file", "path": str(path), "sha256": file_sha256(path), "format": path.suffix.lower()[1:],
                 "windows_available": windows}


# ---- text documents ------------------------------------------------------------------------------
def _text_file(s: Spec) -> tuple[list, dict]:
    path = s.path
    suffix = path.suffix.lower()
    if suffix == ".txt":
        utf8 = _Utf8(path)
        text = utf8.decode(path.read_bytes())
        utf8.check()
        docs: list = [{"text": d.strip()} for d in re.split(r"\n\s*\n", text) if d.strip()]
    elif suffix == ".jsonl":
        docs, utf8 = [], _Utf8(path)
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = utf8.decode(raw)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}); write one JSON object per line") from None
                docs.append(document(row, f"{path}:{lineno}"))
        utf8.check()
    else:
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise ConfigError(f"{path}: not a readable parquet file ({type(e).__name__}: {_first_line(e)})") from None
        docs = [document(row, f"{path}: row {i}") for i, row in enumerate(rows)]
    if not docs:
        raise ConfigError(f"{path}: no documents; add text (blank lines separate .txt documents)")
    return docs, {"kind": "file", "path": str(path), "sha256": file_sha256(path), "format": suffix[1:]}


# ---- Hugging Face datasets -----------------------------------------------------------------------
def _hf_documents(s: Spec, seed: int) -> tuple[Iterator[dict], dict]:
    """Documents of a dataset in a seeded shuffled order; streamed unless saved with save_to_disk."""
    source = {"kind": "hf", "dataset": s.dataset, "config": s.config, "split": s.split, "revision": s.revision,
              "local": s.path is not None}
    return (document(row, f"{s.normalized}: row") for row in _hf_rows(s, seed)), source


def _hf_rows(s: Spec, seed: int) -> Iterator[dict]:
    import datasets

    saved = s.path is not None and any((s.path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json"))
    try:
        if saved:  # a Dataset.save_to_disk folder: random access, so a full seeded permutation
            ds = datasets.load_from_disk(str(s.path))
            if isinstance(ds, datasets.DatasetDict):
                if s.split not in ds:
                    raise ConfigError(f"{s.normalized}: no split {s.split!r} (has: {', '.join(ds)}); write @<split>")
                ds = ds[s.split]
            order = list(range(len(ds)))
            random.Random(seed).shuffle(order)
            for i in order:
                yield ds[i]
        else:
            ds = datasets.load_dataset(s.dataset, s.config, split=s.split, revision=s.revision, streaming=True)
            yield from _buffer_shuffle(iter(ds), SHUFFLE_BUFFER, random.Random(seed))
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many types (not found, bad split, offline, auth, corrupt file)
        raise ConfigError(f"{s.normalized}: cannot load the dataset ({type(e).__name__}: {_first_line(e)}); "
                          "check the name, config and split, or download it and pass a local file") from None


def _buffer_shuffle(rows: Iterator, size: int, rng: random.Random) -> Iterator:
    """Seeded shuffle of a stream through a buffer of `size` items (ours, not datasets', so the
    order does not depend on the datasets version)."""
    buf = list(islice(rows, size))
    for row in rows:
        i = rng.randrange(len(buf))
        yield buf[i]
        buf[i] = row
    rng.shuffle(buf)
    yield from buf


class _Utf8:
    """Decodes a text file's bytes, counting those that are not UTF-8. A few stray bytes in real
    text become U+FFFD; a file where more than MAX_BAD of the bytes are not UTF-8 is not text
    (300 KB of random bytes used to calibrate with exit 0 and most experts starved), so it is
    refused with the fraction found."""

    MAX_BAD = 0.01
    _SURROGATE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a bad byte

    def __init__(self, path: Path):
        self.path, self.total, self.bad, self.first, self.nul = path, 0, 0, None, 0

    def decode(self, raw: bytes) -> str:
        if self.total == 0 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
            self._utf16("a UTF-16 byte-order mark")
        self.nul += raw.count(0)
        text = raw.decode("utf-8", errors="surrogateescape")
        hits = self._SURROGATE.findall(text)
        if hits:
            if self.first is None:
                self.first = self.total + len(text[:self._SURROGATE.search(text).start()].encode("utf-8", "surrogateescape"))
            self.bad += len(hits)
            text = self._SURROGATE.sub("\ufffd", text)
        self.total += len(raw)
        return text

    def _utf16(self, found: str) -> None:
        raise ConfigError(f"{self.path}: UTF-16 text ({found}), not UTF-8; calibration text must be UTF-8: "
                          "re-encode it (iconv -f utf-16 -t utf-8) or use another file")

    def check(self) -> None:
        if self.total and self.nul > self.MAX_BAD * self.total:  # ASCII in UTF-16 without a BOM: a NUL per letter
            self._utf16(f"{self.nul / self.total:.0%} of its bytes are NUL")
        if self.total and self.bad > self.MAX_BAD * self.total:
            raise ConfigError(
                f"{self.path}: {self.bad / self.total:.1%} of its {self.total:,} bytes are not valid UTF-8 (the first "
                f"at byte {self.first}); calibration text must be UTF-8 text: re-encode it (iconv -t utf-8) or use "
                "another file")


# ---- tokenization and packing --------------------------------------------------------------------
@lru_cache(maxsize=4)
def _load_tokenizer(folder: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=True)


def open_tokenizer(folder: Path, trust_remote_code: bool = False):
    """The tokenizer in `folder` (loaded once per process), or one line saying what is wrong with it."""
    return _tokenizer(Path(folder), trust_remote_code, str(folder))


def _tokenizer(folder: Path | None, trust_remote_code: bool, spec: str):
    if folder is None:
        raise ConfigError(f"{spec}: text data needs a tokenizer; pass the model folder as tokenizer")
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: tokenizer folder not found; pass the model folder that holds tokenizer files")
    try:
        return _load_tokenizer(str(folder.resolve()), bool(trust_remote_code))
    except Exception as e:  # transformers raises ValueError/OSError/ImportError for missing or remote-code tokenizers
        cfg = folder / "tokenizer_config.json"
        remote = cfg.is_file() and "auto_map" in cfg.read_text(errors="replace")
        fix = ("it ships its own code: pass --trust-remote-code if you trust it" if remote and not trust_remote_code
               else "check the tokenizer files (tokenizer.json / tokenizer_config.json)")
        raise ConfigError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {_first_line(e)}); {fix}") from None


def _tokenize(tok, texts: Iterable[str]) -> Iterator[list[int]]:
    it = iter(texts)
    while batch := list(islice(it, _TOKENIZE_BATCH)):
        # verbose=False: transformers' "Token indices sequence length is longer than the specified maximum"
        # is about feeding the model whole documents; calibration packs them into seq_len windows
        yield from tok(batch, add_special_tokens=False, verbose=False)["input_ids"]


def _pack(docs: Iterable[list[int]], tok, n: int, L: int, spec: str) -> tuple[torch.Tensor, int]:
    """Join documents as [BOS] doc [EOS] ... and cut the first n*L tokens into n windows."""
    bos, eos = tok.bos_token_id, tok.eos_token_id
    need, stream, used = n * L, [], 0
    for ids in docs:
        if not ids:
            continue
        if bos is not None and ids[0] != bos:
            stream.append(bos)
        stream.extend(ids)
        if eos is not None and ids[-1] != eos:
            stream.append(eos)
        used += 1
        if len(stream) >= need:
            return torch.tensor(stream[:need], dtype=torch.int64).view(n, L), used
    raise ConfigError(
        f"{spec}: only {len(stream)} tokens in {used} documents, need {n}x{L} = {need}; "
        f"lower num_samples or seq_len, or use a larger dataset")


MAX_UNKNOWN = 0.5  # share of the tokens that may be the tokenizer's unknown token


def _check_known(ids: torch.Tensor, tok, spec: str) -> None:
    """Text that tokenizes to mostly the unknown token is not in the model's language (binary
    data, or text for another vocabulary): calibrating on it starves the experts real text uses."""
    unk = getattr(tok, "unk_token_id", None)
    if unk is None or not ids.numel():
        return
    frac = float((ids == unk).float().mean())
    if frac > MAX_UNKNOWN:
        raise ConfigError(
            f"{spec}: {frac:.1%} of its first {ids.numel():,} tokens are the tokenizer's unknown token "
            f"{tok.unk_token!r}; this is not text the model's tokenizer knows (binary data, or another "
            "language or vocabulary): use real text")


def _check_vocab(ids: torch.Tensor, folder: Path, spec: str) -> None:
    """Ids must index the model's embedding (catches token files made with another tokenizer)."""
    if not ids.numel():
        return
    _, vocab = _vocab_size(folder)
    if vocab and int(ids.max()) >= vocab:
        raise ConfigError(f"{spec}: token id {int(ids.max())} >= the model's vocab_size {vocab}; "
                          "tokenize the data with this model's tokenizer")


def _vocab_size(folder: Path) -> tuple[dict, int | None]:
    """The folder's config.json (empty when there is none) and its vocab_size (a multimodal config's
    text_config's), None when it names none."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    return cfg, cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
