"""Writing a sharded safetensors checkpoint: parts cut per layer and saved in the background into
`<out>.partial/`, renamed to `<out>/` only when complete, so a folder under its final name is
always a whole checkpoint. (A convert output is finished by quantkit.checkpoint.finish instead,
which makes the end crash-proof; `finish()` here is for single checkpoints: the tiny and
realshape models, the benchmarks, tests.)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from quantkit.checkpoint.index import INDEX, read_header
from quantkit.errors import OutputError
from quantkit.runtime import faults
from quantkit.runtime.files import readable_per_umask, with_filename


class CheckpointWriter:
    """Writes a sharded safetensors checkpoint into `<out>.partial/`, renamed to `<out>` on finish.

    Shards are cut at `flush()` (the converter flushes after every layer, which makes a resumed
    run write exactly the shards an uninterrupted one would) or when a buffer passes
    `max_shard_bytes`. Shard names get their final `-of-N` only in `finish()`.

    `owns(i)`, when given, says whether this process writes part i: in a multi-rank convert every
    rank adds the same tensors in the same order, so all agree on where parts are cut and what
    they are named, and each saves only the parts it owns (quantkit.runtime.distributed).

    A cut part is saved by a background thread while the caller computes the next one (a
    converter's writing then overlaps its compute instead of adding to it: 1.2 TB for GLM 5.2 is
    10 minutes at 2 GB/s); at most `MAX_PENDING` parts wait or are being saved, so memory stays
    bounded. `drain()` returns once every cut part is on disk (and raises a failed save's error):
    call it before recording progress that names the parts. A part is saved as `.tmp` and renamed,
    so a crash never leaves a part that looks whole but is not.
    """

    MAX_PENDING = 1

    def __init__(self, out: str | Path, *, max_shard_bytes: int = 5 * 2**30, digits: int = 5, resume: bool = False,
                 owns: Callable[[int], bool] | None = None):
        self.out = Path(out)
        self.tmp = self.out.with_name(self.out.name + ".partial")
        self.max_shard_bytes = max_shard_bytes
        self.digits = digits
        if self.out.exists():
            raise OutputError(f"{self.out}: already exists; remove it or choose another --out")
        if self.tmp.exists() and not resume:
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._parts = sorted(p.name for p in self.tmp.glob("part-*.safetensors"))
        self.owns = owns
        self.written = 0  # parts this process saved
        self._saver = None  # a one-thread executor, started with the first save
        self._pending: list = []  # futures of the saves not known to be done, oldest first

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buf:
            raise ValueError(f"tensor {name} added twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self._buf[name] = tensor.detach().to("cpu").contiguous()  # host memory (the plan's `writer`), not the GPU's
        self._buf_bytes += nbytes

    def flush(self) -> None:
        """Cut a part of what was added and hand it to the saving thread (see the class docstring)."""
        if not self._buf:
            return
        name = f"part-{len(self._parts):06d}.safetensors"
        if self.owns is None or self.owns(len(self._parts)):
            self._settle(self.MAX_PENDING - 1)  # room for one more; a failed save raises here
            if self._saver is None:
                from concurrent.futures import ThreadPoolExecutor

                self._saver = ThreadPoolExecutor(1, thread_name_prefix=f"save-{self.out.name}")
            self._pending.append(self._saver.submit(self._save, dict(sorted(self._buf.items())), name))
            self.written += 1
        self._parts.append(name)
        self._buf, self._buf_bytes = {}, 0

    def _save(self, tensors: dict[str, torch.Tensor], name: str) -> None:
        tmp = self.tmp / (name + ".tmp")
        try:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        except (OSError, SafetensorError) as e:  # the error names the file (a full disk, a file size limit)
            named = with_filename(e, tmp)
            if named is None:
                raise
            raise named from e
        readable_per_umask(tmp)
        faults.point("flush:tmp")
        os.replace(tmp, self.tmp / name)

    def _settle(self, keep: int) -> None:
        """Wait until at most `keep` saves are pending, oldest first; re-raise a failed one's error."""
        while self._pending and (len(self._pending) > keep or self._pending[0].done()):
            self._pending.pop(0).result()

    def drain(self) -> None:
        """Every part cut so far is on disk under its part name."""
        self._settle(0)

    @property
    def num_parts(self) -> int:
        return len(self._parts)

    @property
    def parts(self) -> list[str]:
        """The part files written so far, in order (quantkit.checkpoint.finish names them model-*-of-N)."""
        return list(self._parts)

    def adopt_parts(self, n: int) -> None:
        """Resume, on a rank other than the one that truncated: the first n parts are the written
        ones (names only: the files are whoever wrote them)."""
        self._parts = [f"part-{i:06d}.safetensors" for i in range(n)]

    def truncate_parts(self, n: int) -> None:
        """Resume: drop the parts written after the last saved state, and anything else a crash
        left in the folder: a part's `.tmp`, and the temporary file safetensors writes a part
        through (`.tmpXXXXXX`) when the crash came mid-save."""
        keep = set(self._parts[:n])
        for stale in self.tmp.iterdir():
            if stale.name not in keep:
                stale.unlink()
        self._parts = self._parts[:n]

    def finish(self, config: dict, *, files: list[Path] = (), extra: dict[str, str] | None = None) -> Path:
        """Write config, index and carried files, name the shards, and rename into place."""
        self.flush()
        self.drain()
        n = len(self._parts)
        weight_map, total = {}, 0
        for i, part in enumerate(self._parts):
            final = f"model-{i + 1:0{self.digits}d}-of-{n:0{self.digits}d}.safetensors"
            header = read_header(self.tmp / part)
            for t, v in header.items():
                weight_map[t] = final
                total += v["data_offsets"][1] - v["data_offsets"][0]
            os.replace(self.tmp / part, self.tmp / final)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (self.tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in files:
            shutil.copy2(f, self.tmp / f.name)
        for name, text in (extra or {}).items():
            (self.tmp / name).write_text(text)
        os.replace(self.tmp, self.out)
        return self.out
