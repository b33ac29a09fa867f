"""What a calibrated method sees of one MoE layer: its calibration rows, as a neutral type.

convert holds every calibration token's MoE input x and routing in its activation store
(quantkit.conversion.activations.StoreRows implements this protocol); the whole-layer tests build
theirs from plain tensors. A method (quantkit.quant.methods) reads the rows either one micro-batch
at a time (`batches`: what GPTQ's streamed Hessians observe, so no token-sized tensor exists beyond
the store) or gathered whole (`gather`: AWQ's search, budgeted by the planner). `probe`, when a
method asked for extra windows (Method.probe_windows), is the same view of those windows, which run
through the same quantized layers but are never fitted on.

Nothing here imports torch at load: the registry that names this type is read by the CLI's help.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["Batch", "LayerRows"]


class Batch(NamedTuple):
    """One micro-batch of a layer's calibration rows."""

    start: int  # the micro-batch's first token in the layer's token list (window i starts at i * seq_len)
    x: torch.Tensor  # (B T, D) float32: the MoE inputs
    idx: torch.Tensor  # (B T, k): the top-k routed expert ids
    weight: torch.Tensor  # (B T, k): their router weights


class LayerRows(Protocol):
    """One MoE layer's calibration rows (see the module docstring)."""

    @property
    def tokens(self) -> int:
        """N T: the layer's calibration tokens."""
        ...

    @property
    def seq_len(self) -> int:
        """T: tokens per calibration window."""
        ...

    @property
    def idx(self) -> torch.Tensor:
        """(N T, k): every token's top-k routed expert ids, in token order."""
        ...

    @property
    def weight(self) -> torch.Tensor:
        """(N T, k): their router weights."""
        ...

    @property
    def counts(self) -> torch.Tensor:
        """(E,): routed tokens per expert."""
        ...

    @property
    def probe(self) -> LayerRows | None:
        """The probe windows' rows of this layer (Method.probe_windows), or None."""
        ...

    def batches(self) -> Iterator[Batch]:
        """Every micro-batch, in token order (x read afresh as float32: the caller may drop it)."""
        ...

    def gather(self) -> torch.Tensor:
        """(N T, D) float32: every token's MoE input at once (budgeted by the planner)."""
        ...

    def routed(self, experts: list[int]) -> dict[int, torch.Tensor]:
        """For each of `experts`, the indices of the tokens routed to it."""
        ...
