"""One convert's settled inputs, handed from step to step of quantkit.conversion.pipeline.

Once the source is open, the recipe resolved, the ranks joined and the state read, these no
longer change during the run (the state is the exception: it is the progress, updated after each
layer); the steps read them from one object instead of a dozen arguments each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.resume import State
from quantkit.planner.precision import Decision

if TYPE_CHECKING:
    from quantkit.model.arch import ModelArch
    from quantkit.planner.cost import ConvertCost
    from quantkit.quant.methods import Method
    from quantkit.recipe import Recipe
    from quantkit.runtime.distributed import Group


@dataclass
class Job:
    """The source and every tensor's decision, the recipe and its method, where the work runs (device,
    ranks), the plan (set once quantkit.planner.cost has sized the run), and the progress."""

    ckpt: Checkpoint
    rec: Recipe  # overrides applied
    decisions: dict[str, Decision]
    group: Group  # SINGLE for a plain run
    dev: torch.device
    dtype: torch.dtype
    state: State
    state_dir: Path
    cost: ConvertCost | None = None  # set by the pipeline once quantkit.planner.cost has sized the run
    method: Method = field(init=False)  # the recipe's method, resolved once: every stage asks this object

    def __post_init__(self) -> None:
        self.method = self.rec.resolved_method

    @property
    def arch(self) -> ModelArch:
        return self.ckpt.arch

    @property
    def G(self) -> int:
        """The decode checkpoint's INT4 group size."""
        return self.rec.group_size
