"""Architectures: one dataclass for the DeepSeek-V3 family, built from config.json with the help of
the family's definition (quantkit.model.families: where the text config and tensors sit, whether
there is an indexer, the rope layout).

DeepSeek-V3, Kimi K2/K2.5/K2.6 and GLM-5.x share one skeleton: MLA attention (low-rank q and
kv projections, a 576-wide latent cache), a few dense MLP layers, then MoE layers with a sigmoid
`noaux_tc` router, a correction bias and one shared expert. They differ in sizes, in where the
text model sits inside the checkpoint (Kimi K2.5+ nests it under `text_config` and prefixes
tensors with `language_model.`), in RoPE flavour, and GLM adds DeepSeek Sparse Attention (a
"lightning indexer" per layer, shared across layers by IndexShare) and keeps an MTP layer.

Everything downstream reads these explicit fields; nothing infers a feature from a tensor shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from quantkit.errors import ConfigError
from quantkit.model.families import family_of
from quantkit.model.family import Family
from quantkit.model.presets import load_preset, preset_names  # noqa: F401  (quantkit.model.arch is where callers find them)


@dataclass(frozen=True)
class ModelArch:
    """The text model of one checkpoint, as the reference forward and the converter see it."""

    model_type: str  # outer model_type from config.json
    family: str  # "deepseek_v3" | "kimi" | "glm"
    prefix: str  # tensor-name prefix of the decoder: "model." or "language_model.model."
    head_name: str  # "lm_head.weight" or "language_model.lm_head.weight"

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int  # dense MLP width
    rms_norm_eps: float
    tie_word_embeddings: bool

    # moe
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]  # per decoder layer: MoE (True) or dense MLP (False)

    # mla
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    # rope
    rope: dict[str, Any]  # rope_type, rope_theta, and yarn's factor/original_max_position_embeddings/...
    rope_interleave: bool
    max_position_embeddings: int

    # dsa (GLM): None when the model has no indexer
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_layers: tuple[bool, ...] | None = None  # per layer: owns an indexer (True) or reuses the last one

    # mtp: extra decoder layers after the last one (index num_hidden_layers...), carried, never run
    num_mtp_layers: int = 0

    # the sizes only this arch's attention kind reads, by their config.json names (e.g. key/value
    # heads and a head width): what its `Attention.sizes` returns beyond the fields above, so that a
    # new kind adds no field here
    attention_sizes: dict[str, int] = field(default_factory=dict)

    quantization_config: dict[str, Any] | None = None  # the source's, as found
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def definition(self) -> Family:
        """The family's declarations (quantkit.model.family): what every stage asks instead of the name."""
        return family_of(self.model_type)

    # derived sizes
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_dsa(self) -> bool:
        return self.indexer_layers is not None

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_mtp_layers

    @property
    def kv_cache_width(self) -> int:
        """Elements cached per token per layer by MLA: the normalised latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def size(self, name: str) -> int:
        """A size field by name, its attention kind's own ones (`attention_sizes`) included."""
        return self.attention_sizes[name] if name in self.attention_sizes else getattr(self, name)

    def layer_prefix(self, layer: int) -> str:
        return f"{self.prefix}layers.{layer}."

    def is_moe(self, layer: int) -> bool:
        """MTP layers are MoE layers in every published checkpoint of these families."""
        return layer >= self.num_hidden_layers or self.moe_layers[layer]

    def to_json(self) -> dict[str, Any]:
        d = {}
        for k in self.__dataclass_fields__:
            if k == "attention_sizes":
                d |= self.attention_sizes  # flat, as config.json names them
            elif k != "raw":
                d[k] = getattr(self, k)
        d["moe_layers"] = list(self.moe_layers)
        d["indexer_layers"] = None if self.indexer_layers is None else list(self.indexer_layers)
        return d


def _text_config(cfg: dict[str, Any], fam: Family) -> dict[str, Any]:
    """The text model's config: the whole config.json, or the object the family nests it in."""
    if fam.text_config is None:
        return cfg
    text = cfg.get(fam.text_config)
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: model_type {fam.model_type} needs a {fam.text_config} object")
    return text


def _indexer_layers(text: dict[str, Any], n_layers: int) -> tuple[bool, ...]:
    """Which layers own a DSA indexer (GLM-5.2 IndexShare); GLM-5/5.1 have one on every layer.

    A layer runs its own indexer iff max(i - offset + 1, 0) % freq == 0. An explicit
    `indexer_types` list or `index_topk_pattern` string ("F"ull / "S"hared) wins over the rule.
    """
    if isinstance(text.get("indexer_types"), list):
        return tuple(t == "full" for t in text["indexer_types"])
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return tuple(c in ("F", "full") for c in pattern)
    freq = max(int(text.get("index_topk_freq", 1)), 1)
    offset = int(text.get("index_skip_topk_offset", 2))
    return tuple(max(i - offset + 1, 0) % freq == 0 for i in range(n_layers))


def _rope(text: dict[str, Any]) -> dict[str, Any]:
    """Normalise the legacy `rope_theta` + `rope_scaling` pair and the newer `rope_parameters`."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope.setdefault("rope_theta", text.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_type"] = rope_type
    rope.pop("type", None)
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"config.json: rope_type {rope_type!r} is not supported (default, yarn)")
    if rope_type == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if key not in rope:
                raise ConfigError(f"config.json: yarn rope needs {key!r} in rope_scaling")
    return rope


_POSITIVE = ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
             "n_routed_experts", "num_experts_per_tok", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group", "moe_layer_freq",
             "max_position_embeddings", "index_topk_freq")
_NON_NEGATIVE = ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers", "index_n_heads",
                 "index_head_dim", "index_topk", "index_skip_topk_offset")
_NUMBERS = ("rms_norm_eps", "routed_scaling_factor", "rope_theta")
_NUMBER_RANGE = {"rms_norm_eps": "finite and >= 0 (the norms divide by sqrt(mean(x^2) + eps))",
                 "routed_scaling_factor": "finite and >= 0 (it scales the routed experts' sum)",
                 "rope_theta": "finite and positive (rope's frequencies are powers of it)"}


def _check_types(text: dict[str, Any], source: str) -> None:
    """Every field quantkit reads as a number is one (a string, bool or list is a one-line error,
    not a traceback from int()); sizes are positive. null means "not set" and is left to the parser."""
    for key in _POSITIVE + _NON_NEGATIVE:
        v = text.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
            raise ConfigError(f"{source}: {key} is {v!r} ({type(v).__name__}); it must be an integer, fix config.json")
        if v < (1 if key in _POSITIVE else 0):
            raise ConfigError(f"{source}: {key} is {v!r}; it must be {'positive' if key in _POSITIVE else '>= 0'}, fix config.json")
    for key in _NUMBERS:
        v = text.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{source}: {key} is {v!r} ({type(v).__name__}); it must be a number, fix config.json")
        if not math.isfinite(v) or v < 0 or (key == "rope_theta" and v == 0):
            raise ConfigError(f"{source}: {key} is {v!r}; it must be {_NUMBER_RANGE[key]}, fix config.json")


def arch_from_config(cfg: dict[str, Any], *, source: str = "config.json") -> ModelArch:
    """Parse a config.json dict of a supported family into a ModelArch."""
    model_type = cfg.get("model_type")
    fam = family_of(model_type, source=source)
    text = _text_config(cfg, fam)
    _check_types(text, source)
    if fam.config_view is not None:  # a family whose config.json names the fields otherwise
        text = fam.config_view(text)

    def need(key: str) -> Any:
        if key not in text:
            raise ConfigError(f"{source}: missing {key!r} for model_type {model_type}")
        return text[key]

    n_layers = int(need("num_hidden_layers"))
    first_dense = int(text.get("first_k_dense_replace", 0))
    moe_freq = int(text.get("moe_layer_freq", 1))
    if isinstance(text.get("mlp_layer_types"), list):
        moe_layers = tuple(t == "sparse" for t in text["mlp_layer_types"])
    else:
        moe_layers = tuple(i >= first_dense and i % moe_freq == 0 for i in range(n_layers))
    if text.get("scoring_func", "sigmoid") != "sigmoid":
        raise ConfigError(f"{source}: scoring_func {text['scoring_func']!r} is not supported (sigmoid)")

    dsa = fam.indexer
    sizes = fam.attention.sizes(text, need, source)  # its kind reads its sizes (quantkit.model.attention)
    shared = {k: v for k, v in sizes.items() if k in ModelArch.__dataclass_fields__}
    n_mtp = int(text.get("num_nextn_predict_layers", 0) or 0)
    arch = ModelArch(
        model_type=model_type,
        family=fam.name,
        prefix=fam.prefix,
        head_name=fam.head_name,
        vocab_size=int(need("vocab_size")),
        hidden_size=int(need("hidden_size")),
        num_hidden_layers=n_layers,
        intermediate_size=int(need("intermediate_size")),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        moe_intermediate_size=int(need("moe_intermediate_size")),
        n_routed_experts=int(need("n_routed_experts")),
        num_experts_per_tok=int(need("num_experts_per_tok")),
        n_shared_experts=int(text.get("n_shared_experts", 1) or 0),
        n_group=int(text.get("n_group", 1) or 1),
        topk_group=int(text.get("topk_group", 1) or 1),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        moe_layers=moe_layers,
        num_attention_heads=int(need("num_attention_heads")),
        **shared,
        attention_sizes={k: v for k, v in sizes.items() if k not in shared},
        rope=_rope(text),
        # transformers' DeepSeek-V3 defaults to interleaved rope (the original weights' layout);
        # a family whose modelling code ignores the field (GLM) declares its layout.
        rope_interleave=(bool(text.get("rope_interleave", True)) if fam.forced_rope_interleave is None
                         else fam.forced_rope_interleave),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        index_n_heads=int(text.get("index_n_heads", 0)) if dsa else 0,
        index_head_dim=int(text.get("index_head_dim", 0)) if dsa else 0,
        index_topk=int(text.get("index_topk", 0)) if dsa else 0,
        indexer_layers=_indexer_layers(text, n_layers) if dsa else None,
        num_mtp_layers=n_mtp,
        quantization_config=text.get("quantization_config") or cfg.get("quantization_config"),
        raw=cfg,
    )
    if len(arch.moe_layers) != n_layers:
        raise ConfigError(f"{source}: mlp_layer_types has {len(arch.moe_layers)} entries for {n_layers} layers")
    if dsa and not arch.indexer_layers[0]:
        raise ConfigError(f"{source}: layer 0 must own a DSA indexer (IndexShare reuses the previous layer's)")
    _check_invariants(arch, source, dsa=dsa)
    return arch


def _check_invariants(arch: ModelArch, source: str, *, dsa: bool) -> None:
    """What the router and the reference forward assume of the sizes, checked when the config is
    read (before any layer): otherwise a top-k above the expert count ends in torch's "selected index
    k out of range" at layer 0, and a top-k above the chosen groups' experts silently routes tokens
    to experts masked out with -inf."""
    a, fix = arch, "fix config.json"
    if a.n_routed_experts % a.n_group:
        raise ConfigError(f"{source}: n_routed_experts {a.n_routed_experts} not divisible by n_group {a.n_group}; {fix}")
    if any(a.moe_layers) or a.num_mtp_layers:
        if a.num_experts_per_tok > a.n_routed_experts:
            raise ConfigError(f"{source}: num_experts_per_tok {a.num_experts_per_tok} is more than n_routed_experts "
                              f"{a.n_routed_experts}: a token cannot be routed to that many experts; {fix}")
        if a.topk_group > a.n_group:
            raise ConfigError(f"{source}: topk_group {a.topk_group} is more than n_group {a.n_group}; {fix}")
        reachable = a.topk_group * (a.n_routed_experts // a.n_group)
        if a.n_group > 1 and a.num_experts_per_tok > reachable:
            raise ConfigError(f"{source}: num_experts_per_tok {a.num_experts_per_tok} is more than the {reachable} experts "
                              f"of the topk_group {a.topk_group} groups a token may use ({a.n_routed_experts} experts in "
                              f"n_group {a.n_group}); {fix}")
    if a.qk_rope_head_dim % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim {a.qk_rope_head_dim} is odd; rope rotates pairs of dimensions, "
                          f"so it must be even; {fix}")
    if dsa and a.index_topk < 1:
        raise ConfigError(f"{source}: index_topk is {a.index_topk}; the DSA indexer keeps at least one key; {fix}")


NO_MTP = "no MTP layer in the source: speculative decoding unavailable"


def without_mtp(arch: ModelArch) -> ModelArch:
    """The architecture with its MTP layers dropped, config included (`num_nextn_predict_layers: 0`,
    where the text config keeps it), for a checkpoint whose config declares MTP layers its shards do
    not hold: transformers' `save_pretrained` writes DeepSeek-V3's default of 1 and no MTP tensor,
    and so does every fine-tune saved that way. The outputs' configs then say 0, so that engines
    do not look for the layer."""
    import copy

    raw = copy.deepcopy(arch.raw)
    nest = arch.definition.text_config
    text = raw.get(nest) if nest is not None else raw
    if isinstance(text, dict) and "num_nextn_predict_layers" in text:
        text["num_nextn_predict_layers"] = 0
    return replace(arch, num_mtp_layers=0, raw=raw)


def load_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found; a model folder needs config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: must be a JSON object, not {type(cfg).__name__}")
    return cfg


def load_arch(folder: Path) -> ModelArch:
    return arch_from_config(load_config(folder), source=str(Path(folder) / "config.json"))
