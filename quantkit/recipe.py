"""Conversion recipes: one YAML file says how a model becomes its FP8 prefill + INT4 decode pair.

A recipe is validated once, up front, by pydantic models with `extra="forbid"`, so a typo is an
error rather than a silently ignored setting. Every problem becomes one line naming the file, the
field path and the fix:

    recipes/x.yaml: gptq.dampening: must be > 0 (got 0)
    recipes/x.yaml: gptq.dampning: unknown field; did you mean 'dampening'?

Shipped recipes live in `recipes/` at the top of the repo (kimi-k2.6, glm-5.2, deepseek-v3 and the
tiny-* ones for the embedded tiny models); `load_recipe("kimi-k2.6")` finds them by name. docs/recipes.md is the
field reference.
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from quantkit.errors import ConfigError
from quantkit.quant.methods import METHODS, Method, Settings, unknown_method

__all__ = ["Recipe", "load_recipe", "recipe_file", "default_recipe", "recipe_overrides", "resolve_recipe", "recipe_dirs", "available_recipes"]

# A projection `prefill.keep_bf16` may name: the last component of a module name. Which ones a model
# has is its family definition's (quantkit.model.family); `resolve_recipe` checks them against it.
_PROJECTION = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# CLI option -> field path, for recipe_overrides and its error messages.
_OVERRIDES = {
    "method": ("method",),
    "group_size": ("group_size",),
    "num_samples": ("calibration", "num_samples"),
    "seq_len": ("calibration", "seq_len"),
    "calib": ("calibration", "dataset"),
    "seed": ("calibration", "seed"),
    "decode_rest": ("decode", "rest"),
}


# Every section is strict (quantkit.quant.methods.Settings: extra="forbid", no coercion), the methods' own too.
_Section = Settings


class MixSource(_Section):
    """One source of a calibration mix: a data spec and its share, in tokens or as a weight."""

    data: str = Field(min_length=1)  # a quantkit.inputs.tokens spec (synthetic:train, a local file, hf:org/name@split)
    tokens: int | None = Field(None, ge=1)  # this many tokens (a multiple of seq_len)
    weight: float | None = Field(None, gt=0)  # this share of num_samples windows (the weights sum to 1)


MIX_WEIGHT_SUM = 0.01  # how far the weights may sum from 1 (so 0.33 + 0.33 + 0.34 passes, 0.5 + 0.6 does not)


class Calibration(_Section):
    dataset: str | None = None  # a quantkit.inputs.tokens spec; required by a calibrated method (gptq, awq)
    # several sources instead of one (chat, code, tool calls, another language): quantkit.inputs.mix
    mix: list[MixSource] | None = None
    num_samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=2)  # an MTP layer calibrates on the next token: seq_len - 1 positions a window
    seed: int = Field(0, ge=0)
    # windows of uniform random ids (the `random` spec) on top of num_samples, as a fraction of it: every
    # token's direction in every Hessian, whatever the data leaves out (docs/recipes.md, "The random share")
    extra_random: float = Field(0.0, ge=0, le=1)

    def random_windows(self) -> int:
        """The extra_random windows: round(num_samples x extra_random)."""
        return round(self.num_samples * self.extra_random)

    def windows(self) -> int:
        """Every calibration window: num_samples and the extra_random ones."""
        return self.num_samples + self.random_windows()

    def sources(self) -> list[tuple[str, int]]:
        """(spec, windows) of every source: the one dataset's num_samples, or each mix source's
        windows (tokens / seq_len, or its weight's share of num_samples by largest remainder, ties
        to the earlier source), in the recipe's order; then ("random", its windows) with extra_random."""
        extra = [("random", self.random_windows())] if self.random_windows() else []
        if not self.mix:
            return [(self.dataset, self.num_samples), *extra] if self.dataset else []
        if self.mix[0].tokens is not None:
            return [(m.data, m.tokens // self.seq_len) for m in self.mix] + extra
        total = sum(m.weight for m in self.mix)
        exact = [self.num_samples * m.weight / total for m in self.mix]
        windows = [math.floor(x) for x in exact]
        by_remainder = sorted(range(len(exact)), key=lambda i: (windows[i] - exact[i], i))
        for i in by_remainder[: self.num_samples - sum(windows)]:
            windows[i] += 1
        return [(m.data, n) for m, n in zip(self.mix, windows)] + extra

    def problems(self) -> list[str]:
        """What is wrong with the mix, one line each (field path first); empty when fine."""
        if self.mix is None:
            return []
        if self.dataset:
            return [f"calibration.mix: give calibration.dataset (one source) or calibration.mix (several), not both; "
                    f"remove dataset: {self.dataset}"]
        if not self.mix:
            return ["calibration.mix: empty; list sources as {data: <spec>, weight: <share>} or remove mix"]
        out = []
        for i, m in enumerate(self.mix):
            if (m.tokens is None) == (m.weight is None):
                out.append(f"calibration.mix[{i}]: {m.data}: give tokens or weight (one of them)")
        kinds = {m.tokens is None for m in self.mix}
        if out or len(kinds) > 1:
            return out or ["calibration.mix: some sources give tokens, others weight; use one of them for every source"]
        if self.mix[0].tokens is not None:
            need = self.num_samples * self.seq_len
            for i, m in enumerate(self.mix):
                if m.tokens % self.seq_len:
                    out.append(f"calibration.mix[{i}]: {m.data}: tokens {m.tokens} is not a multiple of seq_len "
                               f"{self.seq_len}; use {max(1, round(m.tokens / self.seq_len)) * self.seq_len}")
            have = sum(m.tokens for m in self.mix)
            if not out and have != need:
                out.append(f"calibration.mix: the tokens sum to {have}, num_samples x seq_len is {need}; "
                           f"set num_samples: {have // self.seq_len}")
            return out
        total = sum(m.weight for m in self.mix)
        if abs(total - 1) > MIX_WEIGHT_SUM:
            return [f"calibration.mix: the weights sum to {total:g}; make them sum to 1 (each is its source's share "
                    f"of the num_samples windows)"]
        for (spec, n), m in zip(self.sources(), self.mix):
            if n == 0:
                out.append(f"calibration.mix: {spec}: weight {m.weight:g} of {self.num_samples} windows is no "
                           f"window; raise its weight or num_samples")
        return out


class PrefillSettings(_Section):
    fp8_block: Literal[128] = 128  # the DeepSeek-native [128, 128] block format both engines load
    keep_bf16: list[str] = []
    shared_experts: Literal["fp8", "bf16"] = "fp8"
    dense_mlp: Literal["fp8", "bf16"] = "fp8"

    @field_validator("keep_bf16")
    @classmethod
    def _projection_names(cls, names: list[str]) -> list[str]:
        for n in names:
            if not _PROJECTION.match(n):
                raise ValueError(f"{n!r} is not a projection name (the last part of a module name, e.g. q_a_proj)")
        if len(set(names)) != len(names):
            raise ValueError("lists a projection twice; remove the duplicate")
        return names


class DecodeSettings(_Section):
    reuse_source_int4: bool = True  # copy source INT4 experts bit for bit when already in the target scheme
    # everything but the routed experts: "prefill" = the prefill checkpoint's bytes (FP8 blocks, shared
    # KV-producing weights); "bf16" = BF16 (Kimi's official INT4 look; the pools' attention then differs)
    rest: Literal["prefill", "bf16"] = "prefill"


class ValidateSettings(_Section):
    dataset: str | None = None  # a quantkit.inputs.tokens spec the calibration never saw; None skips data checks
    num_samples: int = Field(8, ge=1)
    seq_len: int = Field(128, ge=2)
    gen_tokens: int = Field(8, ge=0)
    gates: dict[str, float] = {}  # metric_max / metric_min bounds, e.g. kl_max, top1_min, ppl_delta_max

    @field_validator("gates")
    @classmethod
    def _bounds(cls, gates: dict[str, float]) -> dict[str, float]:
        for k, v in gates.items():
            if not k.endswith(("_max", "_min")):
                raise ValueError(f"gate {k!r} must end in _max or _min (an upper or lower bound), e.g. kl_max, top1_min")
            if not math.isfinite(v):
                raise ValueError(f"gate {k!r} must be a finite number (got {v})")
        return gates


# `validate` shadows BaseModel's deprecated `validate` classmethod; the field is what recipes call it,
# and instance attributes win, so `recipe.validate` is the section. Silence pydantic's warning.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message='Field name "validate"', category=UserWarning)

    class _RecipeBase(_Section):
        name: str = Field(min_length=1)
        method: str = "gptq"  # a registered method (quantkit.quant.methods.METHODS)
        group_size: Literal[32, 64, 128] = 128  # Marlin MoE kernels accept these
        calibration: Calibration = Field(default_factory=Calibration)  # type: ignore[arg-type]  # pydantic's stub
        if TYPE_CHECKING:  # the phases' sections, declared after the methods' in `Recipe` below (the YAML's order)
            prefill: PrefillSettings
            decode: DecodeSettings
            validate: ValidateSettings  # type: ignore[assignment]  # the field, not BaseModel's deprecated classmethod

        @field_validator("method")
        @classmethod
        def _registered(cls, name: str) -> str:
            if name not in METHODS:
                raise ValueError(unknown_method(name))
            return name

        @model_validator(mode="after")
        def _consistent(self) -> _RecipeBase:
            problems = self.calibration.problems()
            sources = [] if problems else self.calibration.sources()
            if METHODS[self.method].calibrated and not (sources or problems):
                free = " or ".join(n for n, m in METHODS.items() if not m.calibrated)
                problems.append(f"calibration.dataset: method {self.method} needs calibration data; "
                                f"add a spec such as synthetic:train or hf:org/name@split, or use method: {free}")
            for m in METHODS.values():  # each method checks its own section against the rest
                problems += m.recipe_problems(self)
            val = _same_data(self.validate.dataset)
            if val is not None and val in {_same_data(spec) for spec, _ in sources}:
                problems.append(f"validate.dataset: {self.validate.dataset} is the calibration data; evaluate on held-out "
                                "data (synthetic:heldout, a test split, or another file)")
            if problems:
                raise ValueError("\n".join(problems))
            return self

        def to_dict(self) -> dict[str, Any]:
            """Plain dict with YAML field names (for reports and round trips)."""
            return self.model_dump()

        @property
        def resolved_method(self) -> Method:
            """The registered method `method` names: the object every stage asks (quantkit.quant.methods).
            The field's validator refused any other name, so this lookup cannot miss."""
            return METHODS[self.method]

    if TYPE_CHECKING:
        class Recipe(_RecipeBase):
            """What a type checker sees of the Recipe built below: every field but the methods' own
            sections, which only their method reads (quantkit.quant.methods, below this module in the
            layers, where a recipe is untyped), reached here as Any."""

            def __getattr__(self, section: str) -> Any: ...
    else:
        # The methods' sections come from the registry (each method declares its own, quantkit.quant.methods):
        # a new method adds its section without touching this file. Field order is the YAML's.
        _sections = {m.section: m.settings for m in METHODS.values() if m.settings is not None}
        Recipe = create_model("Recipe", __base__=_RecipeBase,
                              **{k: (v, Field(default_factory=v)) for k, v in _sections.items()},
                              prefill=(PrefillSettings, Field(default_factory=PrefillSettings)),
                              decode=(DecodeSettings, Field(default_factory=DecodeSettings)),
                              validate=(ValidateSettings, Field(default_factory=ValidateSettings)))
        Recipe.__doc__ = ("A validated recipe: the sections above, each method's own (quantkit.quant.methods), "
                          "and the phases'.")


def _same_data(spec: str | None) -> str | None:
    if not spec:
        return None
    s = spec.strip()
    return "synthetic:train" if s == "synthetic" else s


# ---- loading -------------------------------------------------------------------------------------
def recipe_dirs() -> list[Path]:
    """Where recipe names are looked up: one folder, the first that exists of quantkit/recipes/ (an
    installed wheel, which ships the repo's recipes/ there: setup.py) and the checkout's top-level recipes/."""
    here = Path(__file__).resolve().parent
    return [d for d in (here / "recipes", here.parent / "recipes") if d.is_dir()][:1]


def available_recipes() -> list[str]:
    return sorted({p.stem for d in recipe_dirs() for p in d.glob("*.yaml")})


def load_recipe(path_or_name: str | Path) -> Recipe:
    """A recipe from a YAML path, or by name (`kimi-k2.6`) from the recipes folder."""
    path = _find(path_or_name)
    where = _display(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or _first_line(e)
        raise ConfigError(f"{where}{at}: YAML syntax error: {problem}; fix the YAML (indentation, colons, quotes)") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the recipe ({e.strerror or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a recipe is a YAML mapping of fields (name, method, calibration, ...); "
                          f"got {type(data).__name__}")
    return _validate(data, where)


def recipe_file(path_or_name: str | Path) -> str:
    """The file a recipe path or name reads, as errors name it (relative to the current folder when inside it)."""
    return _display(_find(path_or_name))


def _find(path_or_name: str | Path) -> Path:
    p = Path(path_or_name).expanduser()
    if p.is_file():
        return p
    name = str(path_or_name)
    if "/" not in name and "\\" not in name:
        stem = name[:-5] if name.endswith(".yaml") else name
        for d in recipe_dirs():
            if (d / f"{stem}.yaml").is_file():
                return d / f"{stem}.yaml"
    names = ", ".join(available_recipes()) or "none found"
    raise ConfigError(f"{path_or_name}: no such recipe file or name; pass a YAML path or one of: {names}")


def default_recipe(model_spec: str, arch) -> Recipe:
    """The shipped recipe for a model: tiny:<name> -> tiny-<name>, else by family.

    kimi (model_type kimi_k2 / kimi_k25) -> kimi-k2.6, glm -> glm-5.2, deepseek_v3 (DeepSeek-V3/R1
    and BF16 Kimi K2 variants that ship model_type deepseek_v3) -> deepseek-v3.
    """
    spec = str(model_spec)
    if spec.startswith("tiny:"):
        return load_recipe(f"tiny-{spec[len('tiny:'):]}")
    name = getattr(getattr(arch, "definition", None), "recipe", None)  # the family definition's (quantkit.model.family)
    if name is None:
        raise ConfigError(f"{spec}: no default recipe for {getattr(arch, 'model_type', arch)}; pass one with --recipe "
                          f"(start from one of {', '.join(available_recipes())})")
    return load_recipe(name)


def resolve_recipe(model_spec, arch, recipe: str | Path | None = None, **cli_options: Any) -> Recipe:
    """The recipe convert and `plan --convert` run with: the one named, else the model family's
    (`default_recipe`), with the options given overriding its fields (`recipe_overrides`)."""
    rec = load_recipe(recipe) if recipe is not None else default_recipe(str(model_spec), arch)
    check_projections(rec, arch)
    return recipe_overrides(rec, **cli_options)


def check_projections(rec: Recipe, arch) -> None:
    """`prefill.keep_bf16` names projections the model has (its family definition's
    `recipe_projections`); a one-line error with the closest name otherwise."""
    known = getattr(getattr(arch, "definition", None), "recipe_projections", None)
    if known is None:
        return
    for n in rec.prefill.keep_bf16:
        if n not in known:
            close = difflib.get_close_matches(n, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"recipe {rec.name}: prefill.keep_bf16: unknown projection {n!r} for model_type "
                              f"{arch.model_type}; {hint}choose from {', '.join(known)}")


def recipe_overrides(recipe: Recipe, **cli_options: Any) -> Recipe:
    """`recipe` with CLI options applied: method, group_size, num_samples, seq_len, calib, seed, decode_rest.

    None keeps the recipe's value. The result is validated again (e.g. a new group_size must still
    divide gptq.block_size); errors name the CLI option.
    """
    unknown = sorted(set(cli_options) - set(_OVERRIDES))
    if unknown:
        raise TypeError(f"recipe_overrides: unknown option(s) {', '.join(unknown)}; known: {', '.join(_OVERRIDES)}")
    data = recipe.to_dict()
    changed = False
    for option, value in cli_options.items():
        if value is None:
            continue
        *parents, leaf = _OVERRIDES[option]
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = value
        if option == "calib":  # --calib names the one source: it replaces a recipe's mix
            node["mix"] = None
        changed = True
    if not changed:
        return recipe
    options = {path: "--" + option.replace("_", "-")
               for option, path in _OVERRIDES.items() if cli_options.get(option) is not None}
    return _validate(data, f"command line (recipe {recipe.name})", options)


# ---- errors --------------------------------------------------------------------------------------
def _validate(data: dict, where: str, options: dict[tuple, str] | None = None) -> Recipe:
    """Validate `data`; `options` names the CLI option behind a field path in error messages."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        lines = [line for err in e.errors() for line in _describe(err, where, options or {})]
        raise ConfigError("\n".join(lines)) from None


def _describe(err: Mapping[str, Any], where: str, options: dict[tuple, str]) -> list[str]:
    """One line per problem: `<file>: <field path>: <what is wrong>; <fix>`."""
    loc = tuple(err["loc"])
    field = options.get(loc) or _field_name(loc)
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "value_error":
        message = str(ctx.get("error", err["msg"]))
        if not loc:  # model-level checks already start with their field path, one per line
            return [f"{where}: {line}" for line in message.splitlines()]
        return [f"{where}: {field}: {message}"]
    if kind == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid fields: {', '.join(valid)}"
        return [f"{where}: {field}: unknown field; {hint}"]
    if kind == "missing":
        return [f"{where}: {field}: required; add it"]
    if kind == "literal_error":
        return [f"{where}: {field}: must be one of {ctx.get('expected')} (got {got!r})"]
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return [f"{where}: {field}: must be {bounds[kind]} {limit} (got {got!r})"]
    types = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false", "string_type": "a string",
             "dict_type": "a mapping", "list_type": "a list", "model_type": "a mapping of fields",
             "string_too_short": "a non-empty string"}
    if kind in types or kind.startswith(("int_", "float_")):
        return [f"{where}: {field}: must be {types.get(kind, 'a number')} (got {got!r})"]
    return [f"{where}: {field}: {err['msg']} (got {got!r})"]


def _field_name(loc: tuple) -> str:
    return ".".join(str(x) for x in loc) or "(recipe)"


def _fields_at(loc: tuple) -> list[str]:
    model: type[BaseModel] = Recipe
    for key in loc:
        if isinstance(key, int):  # an item of a list of sections (calibration.mix.0)
            continue
        info = model.model_fields.get(key)
        inner = _section_in(info.annotation) if info is not None else None
        if inner is None:
            return []
        model = inner
    return sorted(model.model_fields)


def _section_in(annotation) -> type[BaseModel] | None:
    """The section model a field holds: itself, or inside `list[...]` / `... | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_section_in, get_args(annotation)) if m is not None), None)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
