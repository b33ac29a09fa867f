"""A calibration set mixed from several sources: chat, code, tool-call transcripts, another language.

GPTQ's Hessians only know the directions the calibration tokens span; an expert that code or a
second language routes to, but chat never does, is calibrated on what it will not serve (or not at
all). A mix calibrates on what users send. Each source is read by `load_tokens` exactly as a
single `--calib` spec would be (same readers, same seed), for its own number of windows; the
windows are then interleaved in a fixed order:

    window j of source i (n_i windows) goes at key ((j + 0.5) / n_i, i), sorted ascending

a stratified interleave: any run of consecutive windows (a micro-batch, every 8th window the
guard holds out) carries the sources in about their shares, and the same recipe always gives the
same ids. A mix of one source is that source's tokens exactly.

    load_mix([("chat.jsonl", 96), ("code.jsonl", 32)], tokenizer=folder, seq_len=2048)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from quantkit.errors import ConfigError, QuantkitError
from quantkit.inputs.tokens import TokenData, load_tokens

__all__ = ["load_mix", "MixSourceError", "interleave_order"]

ORDER = "window j of source i (n_i windows) at key ((j + 0.5) / n_i, i), ascending"


class MixSourceError(ConfigError):
    """One source of a mix could not give its windows; `index` and `spec` name it."""

    def __init__(self, index: int, spec: str, problem: str):
        super().__init__(problem)
        self.index, self.spec, self.problem = index, spec, problem


def interleave_order(counts: list[int]) -> list[tuple[int, int]]:
    """(source, window) pairs in the mix's order (module docstring)."""
    keys = [((j + 0.5) / n, i, j) for i, n in enumerate(counts) for j in range(n)]
    return [(i, j) for _, i, j in sorted(keys)]


def load_mix(
    sources: list[tuple[str, int]],
    *,
    tokenizer: Path | None,
    seq_len: int,
    seed: int = 0,
    trust_remote_code: bool = False,
) -> TokenData:
    """Windows from every (spec, windows) source, interleaved.

    Every source is read before any is used, so a bad one fails the run up front.

    Returns:
        TokenData with ids int64 [sum of windows, seq_len]; `source` records each source's spec,
        windows, tokens, sha256 and where it came from, and the order.
    Raises:
        MixSourceError: a source that cannot be read or gives fewer tokens than asked.
    """
    parts = []
    for i, (spec, windows) in enumerate(sources):
        try:
            parts.append(load_tokens(spec, tokenizer=tokenizer, num_samples=windows, seq_len=seq_len, seed=seed,
                                     trust_remote_code=trust_remote_code))
        except QuantkitError as e:
            raise MixSourceError(i, spec, str(e)) from None
    ids = torch.stack([parts[i].ids[j] for i, j in interleave_order([len(p.ids) for p in parts])])  # [N, L]
    record = [{"spec": p.spec, "windows": int(p.ids.shape[0]), "tokens": int(p.ids.numel()), "sha256": p.sha256,
               "source": p.source} for p in parts]
    spec = "mix:" + "+".join(f"{p.spec}*{p.ids.shape[0]}" for p in parts)
    return TokenData(ids=ids, spec=spec, sha256=hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
                     source={"kind": "mix", "order": ORDER, "sources": record})
