"""The calibration activation store: every calibration token's hidden state, within a memory budget.

Calibration runs the model one layer at a time over all calibration tokens, so the residual
stream h (samples x seq_len x hidden) lives for the whole conversion, and a MoE layer also needs
its input x = post_attention_layernorm(h) while the experts are quantized and their outputs added
to h. At the shipped GLM recipe (512 x 2048 tokens, hidden 6144) one float32 copy is 25.8 GB; a
bf16 copy 12.9 GB. So the store holds exactly these two arrays and nothing else token-sized:

    h  (N, T, D)   the residual stream                      stored dtype: float32 or bfloat16
    x  (N, T, D)   MoE input of the current layer           same dtype (MoE layers only)

in one of two places, chosen by `quantkit.planner.cost` from the budget:

    memory   a tensor on the compute device, or in host memory (the same on a CPU-only run)
    disk     raw files in the state folder, read and written with pread/pwrite a micro-batch at a
             time (the page cache keeps what fits; it is never counted in our RSS)

All compute reads a micro-batch of samples at a time, as float32 on the compute device
(`read`), and writes it back (`write`), so the work space is bounded by the micro-batch, never by
the number of tokens. bfloat16 storage halves the store at the cost of rounding h to 8 bits of
mantissa between layers (docs/benchmarks.md measures the KL this costs on the tiny models).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from quantkit.planner.cost import StorePlan
from quantkit.quant.rows import Batch
from quantkit.runtime.files import with_filename

_NP = {torch.float32: np.float32, torch.bfloat16: np.uint16}  # numpy has no bfloat16: its bits are kept as uint16


class TokenArray:
    """One (N, T, D) array of the store: a tensor (memory), or a raw file read and written with
    explicit positioned I/O (disk), so that its pages sit in the page cache, never in our RSS."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, backing: str, device, compute,
                 path: Path | None = None):
        self.shape, self.dtype, self.backing = tuple(shape), dtype, backing
        self.device, self.compute = torch.device(device), torch.device(compute)
        self.sample_bytes = shape[1] * shape[2] * torch.empty(0, dtype=dtype).element_size()
        if backing == "memory":
            # host memory feeding a GPU is pinned, so the micro-batch copies can overlap compute
            pin = self.device.type == "cpu" and self.compute.type == "cuda"
            self.data = torch.zeros(shape, dtype=dtype, device=self.device, pin_memory=pin)
        elif backing == "disk":
            assert path is not None
            self.path = Path(path)
            with open(self.path, "wb") as f:
                f.truncate(shape[0] * self.sample_bytes)
            self._fd = os.open(self.path, os.O_RDWR)
        else:
            raise ValueError(backing)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.sample_bytes

    def _raw(self, sl: slice) -> torch.Tensor:
        start, stop, _ = sl.indices(self.shape[0])
        if self.backing == "memory":
            return self.data[start:stop]
        buf = os.pread(self._fd, (stop - start) * self.sample_bytes, start * self.sample_bytes)
        arr = np.frombuffer(bytearray(buf), dtype=_NP[self.dtype]).reshape(stop - start, *self.shape[1:])
        return torch.from_numpy(arr).view(self.dtype)

    def read(self, sl: slice) -> torch.Tensor:
        """Samples `sl` as float32 on the compute device, (B, T, D); a new tensor."""
        return self._raw(sl).to(self.compute, torch.float32, copy=True)

    def write(self, sl: slice, value: torch.Tensor) -> None:
        start, stop, _ = sl.indices(self.shape[0])
        if self.backing == "memory":
            self.data[start:stop] = value.to(self.device, self.dtype)
            return
        raw = value.to("cpu", self.dtype).contiguous().view(torch.uint8).numpy().tobytes()
        os.pwrite(self._fd, raw, start * self.sample_bytes)

    def assign(self, value: torch.Tensor, micro_batch: int) -> None:
        for i in range(0, self.shape[0], micro_batch):
            self.write(slice(i, i + micro_batch), value[i:i + micro_batch])

    def save(self, path: Path) -> None:
        """Raw bytes of the array, written through a temporary name (resume state), a sample at a time."""
        tmp = Path(str(path) + ".tmp")
        try:
            with open(tmp, "wb") as f:
                for i in range(self.shape[0]):
                    f.write(self._raw(slice(i, i + 1)).cpu().contiguous().view(torch.uint8).numpy().tobytes())
        except OSError as e:  # write() names no file: the error does (a full disk, a file size limit)
            named = with_filename(e, tmp)
            if named is None:
                raise
            raise named from e
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        with open(path, "rb") as f:
            for i in range(self.shape[0]):
                arr = np.frombuffer(bytearray(f.read(self.sample_bytes)), dtype=_NP[self.dtype])
                self.write(slice(i, i + 1), torch.from_numpy(arr).view(self.dtype).reshape(1, *self.shape[1:]))

    def close(self) -> None:
        if self.backing == "disk":
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
        else:
            del self.data


class ActivationStore:
    """h for every calibration token, plus x for the MoE layer being converted."""

    def __init__(self, n: int, t: int, d: int, plan: StorePlan, compute, folder: Path | None = None, tag: str = ""):
        self.plan, self.compute, self.folder, self.tag = plan, torch.device(compute), folder, tag  # tag: the files' prefix
        self.shape = (n, t, d)
        self.h = self._array("h")
        self.x: TokenArray | None = None

    def _array(self, name: str) -> TokenArray:
        path = None
        if self.plan.backing == "disk":
            if self.folder is None:
                raise ValueError("a disk-backed activation store needs a folder for its files")
            path = self.folder / f"{self.tag}{name}.work"
        device = self.compute if self.plan.location == "device" else torch.device("cpu")
        return TokenArray(self.shape, self.plan.dtype, self.plan.backing, device, self.compute, path)

    def slices(self):
        """Micro-batches of samples, in order."""
        mb = self.plan.micro_batch
        for i in range(0, self.shape[0], mb):
            yield slice(i, min(i + mb, self.shape[0]))

    def open_x(self) -> TokenArray:
        if self.x is None:
            self.x = self._array("x")
        return self.x

    def moe_inputs(self) -> TokenArray:
        """x, which the MoE layer's attention pass opened (`open_x`)."""
        if self.x is None:
            raise RuntimeError("the activation store holds no MoE inputs: the layer's attention pass opens them")
        return self.x

    def close_x(self) -> None:
        if self.x is not None:
            self.x.close()
            self.x = None

    def close(self) -> None:
        self.close_x()
        self.h.close()

    @property
    def tokens(self) -> int:
        return self.shape[0] * self.shape[1]


class LayerRouting:
    """Top-k expert ids (int16) and weights (float32) of every calibration token, (N*T, k)."""

    def __init__(self, idx: list[torch.Tensor], weight: list[torch.Tensor], tokens_per_batch: list[int], n_experts: int):
        self.idx = idx[0] if len(idx) == 1 else torch.cat(idx)  # one list entry: the layer's whole buffer, no copy
        self.weight = weight[0] if len(weight) == 1 else torch.cat(weight)
        self.starts = [0]
        for n in tokens_per_batch:
            self.starts.append(self.starts[-1] + n)
        flat = self.idx.flatten().long()  # counts without a data-dependent shape (bincount's is)
        self.counts = torch.zeros(n_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.starts[i], self.starts[i + 1]
        return self.idx[a:b], self.weight[a:b]


class StoreRows:
    """A MoE layer's calibration rows as a method sees them (a quantkit.quant.rows.LayerRows): the
    store's x and the layer's routing, and the probe windows' (their own store and routing) when
    the method asked for them. Reads only; the layer pass owns both."""

    def __init__(self, store: ActivationStore, routing: LayerRouting, probe: StoreRows | None = None):
        self.store, self.routing, self._probe = store, routing, probe

    @property
    def tokens(self) -> int:
        return self.routing.starts[-1]

    @property
    def seq_len(self) -> int:
        return self.store.shape[1]

    @property
    def idx(self) -> torch.Tensor:
        return self.routing.idx

    @property
    def weight(self) -> torch.Tensor:
        return self.routing.weight

    @property
    def counts(self) -> torch.Tensor:
        return self.routing.counts

    @property
    def probe(self) -> StoreRows | None:
        return self._probe

    def batches(self) -> Iterator[Batch]:
        D = self.store.shape[-1]
        for i, sl in enumerate(self.store.slices()):
            idx_b, wt_b = self.routing.batch(i)
            yield Batch(self.routing.starts[i], self.store.moe_inputs().read(sl).reshape(-1, D), idx_b, wt_b)

    def gather(self) -> torch.Tensor:
        D = self.store.shape[-1]
        x = self.store.moe_inputs()
        return torch.cat([x.read(sl).reshape(-1, D) for sl in self.store.slices()])

    def routed(self, experts: list[int]) -> dict[int, torch.Tensor]:
        idx = self.routing.idx
        return {e: (idx == e).any(-1).nonzero(as_tuple=True)[0] for e in experts}
