"""The method interface, the registry and the one place a method's name is read.

A method is one module of quantkit.quant.methods that owns its calibration. Its class states what
convert and the other stages need from any method:

* what it reads of a layer's calibration rows (`inputs`, a quantkit.quant.rows.LayerRows): nothing,
  the rows one micro-batch at a time (GPTQ's Hessians observe each batch and are dropped), or the
  layer gathered whole (AWQ's search);
* how it solves a chunk of one layer's routed experts: `solve` in convert (from the rows, guarded
  against RTN on held-out rows), `quantize` in its whole-layer form (tensors in, the oracle of the
  streamed form in the tests); both take its own typed settings (`options`: its recipe section, not
  the whole recipe);
* the extra windows it wants run through the quantized layers beside the calibration
  (`probe_windows`: GPTQ's probe for gptq.low_dampening), and what they cost (`probe_cost`);
* its cost for the planner (quantkit.planner.cost: `time_factor`, `cost_note`,
  `flops_per_weight`, and what `inputs` gathers);
* its card and report lines (`settings_line`, `guard_words`, `probe_report`, `kept_words`, and for
  what its own options decided per expert `record_words`, `summary_counts`, `guard_note`), its
  display name and `--method` help, and its recipe section (`section`, `settings`: quantkit.recipe
  adds it to every recipe from the registry) with the checks between that section and the rest of a
  recipe (`recipe_problems`).

A method registers itself with `@register` (as compressed-tensors registers its compressors); the
package imports the shipped ones in the order help texts and reports list them. A name not in
METHODS is refused with the registered ones (`method_for`), so a new name can never run another
method's maths.

Nothing here imports torch at load: quantkit.recipe validates recipes with this module, and the CLI
lists the methods in its help.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

from quantkit.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from quantkit.quant.experts import ExpertRecord
    from quantkit.quant.gptq import QuantizedWeight
    from quantkit.quant.rows import LayerRows

__all__ = ["Inputs", "Method", "METHODS", "ProbeCost", "Settings", "method_for", "register", "unknown_method",
           "quantize_experts"]


class Settings(BaseModel):
    """A recipe section (quantkit.recipe builds every section on this, a method's own included): strict,
    since YAML already gives typed values ("128" or 1.5 for an int is a mistake, not a coercion), and
    an unknown field is an error rather than a silently ignored setting."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class Inputs(Enum):
    """What a method reads of a layer's calibration rows (quantkit.quant.rows.LayerRows); the planner
    budgets by it (quantkit.planner.cost)."""

    NONE = "none"  # the weights alone: no calibration pass, and every layer (MTP included) gets the method
    LAYER = "layer inputs"  # the layer's MoE inputs x (N, D) gathered whole, and each expert's routed token ids
    STREAMED = "micro-batches"  # the rows one micro-batch at a time (LayerRows.batches): GPTQ's Hessians
    EXPERT_ROWS = "expert rows"  # each expert's rows of one chunk, read from the micro-batches: AWQ's search


@dataclass(frozen=True)
class ProbeCost:
    """What a method's probe windows (Method.probe_windows) add to a conversion's plan, beyond running
    the windows themselves (quantkit.planner.cost)."""

    expert_bytes: int  # per expert of a chunk, on top of its usual work space
    work: float  # the quantizing phase's arithmetic, as a multiple of the run without the probe
    cpu_chunk: float  # the CPU's experts-per-chunk cap, as a multiple (batching buys no launches there)
    note: str  # the plan's note


class Method:
    """One quantization method. Subclasses set the class attributes and `quantize`; a calibrated
    one whose convert form is not its gathered whole-layer form also overrides `solve`."""

    name: ClassVar[str]  # what recipes, --method and reports call it
    display: ClassVar[str]  # how tables and cards write it
    help: ClassVar[str]  # a few words for --method's help
    inputs: ClassVar[Inputs]
    section: ClassVar[str | None] = None  # its recipe section (a quantkit.recipe.Recipe field), if it has settings
    settings: ClassVar[type[Settings] | None] = None  # that section's fields; quantkit.recipe adds it to Recipe
    # planner (quantkit.planner.cost): a calibrated method's quantizing phase as a multiple of GPTQ's,
    # and what the plan's notes say about it; a data-free one's work per weight entry, in FLOPs
    time_factor: ClassVar[float] = 1.0
    cost_note: ClassVar[str | None] = None
    flops_per_weight: ClassVar[float] = 20.0

    @property
    def calibrated(self) -> bool:
        """Whether it needs calibration data (then convert runs the calibration pass)."""
        return self.inputs is not Inputs.NONE

    def options(self, recipe) -> Any:
        """Its own typed settings, from a recipe (quantkit.recipe.Recipe): what `solve` and `quantize`
        take. None for a method without settings."""
        return None

    def data_free(self) -> Method:
        """What it stores where there is no calibration path (an uncalibrated MTP layer): itself
        when it needs no data, else RTN."""
        return self if not self.calibrated else METHODS["rtn"]

    def quantize(self, w: dict[str, torch.Tensor], experts: list[int], options: Any, group_size: int, layer: int, *,
                 x: torch.Tensor | None = None, tokens: dict[int, torch.Tensor] | None = None,
                 alternatives: dict | None = None, probe: bool = False) -> tuple[dict[int, dict[str, QuantizedWeight]], list[ExpertRecord]]:
        """({expert: {proj: QuantizedWeight}}, [ExpertRecord]) for `experts` of one layer, the whole-layer form.

        w: the layer's expert weights (mlp.experts.{e}.{proj}.weight), read only; options: its own
        settings (`options`). A calibrated
        method also takes x (N, D), the layer's MoE inputs held whole, and tokens[e], the indices of
        the tokens routed to e. `alternatives`, when a dict, receives other candidates per expert for
        the held-out guard; with probe=True (probe windows are there: `probe_windows`) also those the
        guard judges on the probe first, named quantkit.quant.experts.LOW."""
        raise NotImplementedError

    def solve(self, rows: LayerRows | None, w: dict[str, torch.Tensor], experts: list[int], options: Any, group_size: int,
              layer: int) -> tuple[dict[int, dict[str, QuantizedWeight]], list[ExpertRecord]]:
        """convert's form: `experts` of one layer (their source weights in `w`) from the layer's
        calibration rows (None for a data-free method), every calibrated expert guarded against RTN
        on rows it was not fitted on (quantkit.quant.experts). This default gathers the rows
        (Inputs.LAYER, budgeted by the planner) and runs the whole-layer `quantize`."""
        if rows is None:
            return self.quantize(w, experts, options, group_size, layer)
        from quantkit.quant.experts import guard_experts

        x = rows.gather()  # (N T, D)
        tokens = rows.routed(experts)
        alternatives: dict = {}
        probe = rows.probe
        quantized, records = self.quantize(w, experts, options, group_size, layer, x=x, tokens=tokens,
                                           alternatives=alternatives, probe=probe is not None)
        guard_experts(records, quantized, x, tokens, w, group_size, alternatives,
                      (probe.gather(), probe.routed(experts)) if probe is not None else None)
        return quantized, records

    def probe_windows(self, recipe) -> int:
        """Extra windows (token ids the calibration never contains) it wants run through the
        quantized layers beside the calibration, never fitted on (LayerRows.probe); 0: none."""
        return 0

    def probe_cost(self, windows: int, hidden: int, width: int) -> ProbeCost | None:
        """What its probe adds to the plan beyond running the windows (None without a probe)."""
        return None

    def probe_report(self, recipe, windows: int, seq_len: int) -> dict:
        """convert-report.json's calibration.probe entry when it ran probe windows."""
        return {"windows": windows, "seq_len": seq_len}

    def guard_words(self, recipe) -> str:
        """Which calibration tokens the held-out guard judges on, in the report's words."""
        from quantkit.quant.experts import HOLDOUT

        return f"every {HOLDOUT}th calibration token"

    def kept_words(self, guard: str | None) -> str:
        """The report's words for a stored alternative (an ExpertRecord's `guard`, other than RTN)."""
        return "" if guard is None else f" (stored: its {guard} alternative)"

    def record_words(self, e: dict) -> str:
        """Words this method's own options add to an expert's `why` in the report (e: the expert's report
        entry, stored by whichever method the guard kept), or ''."""
        return ""

    def summary_counts(self, experts: list[dict]) -> dict[str, int]:
        """Counts this method's own options add to the report's experts_summary, or none."""
        return {}

    def guard_note(self, summary: dict) -> str:
        """The card's guard line's words on those counts (summary: the report's experts_summary), or ''."""
        return ""

    def settings_line(self, recipe: dict) -> str | None:
        """The model card's line on this method's settings (recipe: as in convert-report.json)."""
        return None

    def recipe_problems(self, recipe) -> list[str]:
        """What is wrong between its section and the rest of a recipe (quantkit.recipe.Recipe), one line
        each, whichever method the recipe runs: checked when every recipe loads."""
        return []


# The registry: one entry per method, in the order help texts and reports list them (the package
# imports the shipped methods in that order).
METHODS: dict[str, Method] = {}

M = TypeVar("M", bound=type[Method])


def register(cls: M) -> M:
    """Class decorator: register one instance of `cls` under `cls.name` (a name taken is an error)."""
    if cls.name in METHODS:
        raise ValueError(f"method {cls.name!r} is registered already ({type(METHODS[cls.name]).__name__})")
    METHODS[cls.name] = cls()
    return cls


def unknown_method(name: object) -> str:
    """The one-line complaint for a name that is not registered."""
    return f"unknown method {name!r}; use one of the registered methods: {', '.join(METHODS)}"


def method_for(name: str) -> Method:
    """The registered method called `name`; a ConfigError naming the registered ones otherwise."""
    m = METHODS.get(name)
    if m is None:
        raise ConfigError(unknown_method(name))
    return m


def quantize_experts(x: torch.Tensor, w: dict[str, torch.Tensor], tokens: dict[int, torch.Tensor], experts: list[int],
                     recipe, group_size: int, method: str, layer: int, alternatives: dict | None = None):
    """`method`'s whole-layer form for the given routed experts of one layer (`Method.quantize`), from
    the layer's MoE inputs held whole: the oracle of convert's streamed GPTQ
    (tests/quant/methods/test_gptq.py) and what tests/runtime/test_device.py runs on a fake device."""
    m = method_for(method)
    return m.quantize(w, experts, m.options(recipe), group_size, layer, x=x, tokens=tokens, alternatives=alternatives)
