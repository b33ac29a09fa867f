"""Planning: checkpoint sizes, weight memory per GPU and KV-cache capacity, without any weights.

Everything here is arithmetic on the ModelArch. `tensor_inventory` lists every logical tensor a
checkpoint of the architecture holds (shapes from config.json, validated with
`tensors.classify`), and each checkpoint kind assigns a storage format per tensor:

    kind       routed experts        other Linears                    embeddings/head/norms/router
    source     as published: Kimi INT4 g32 (compressed-tensors), GLM/DeepSeek FP8 block 128 (+BF16
               modules_to_not_convert), no quantization_config -> BF16
    bf16       BF16                  BF16                             BF16 (router bias F32)
    prefill    FP8 block 128         FP8 block 128 (*)                BF16
    decode     INT4 group G          as prefill (identical bytes)     BF16
    int4-bf16  INT4 group G          BF16                             BF16   (the article's GLM INT4)

(*) except the indexer's weights_proj, the MTP eh_proj (GLM's FP8 release keeps both BF16) and,
for Kimi, q_a_proj + kv_a_proj_with_mqa, which published FP8 conversions keep BF16 because their
fused 2112-row output breaks vLLM's 128-block check.

Storage per Linear [out, in]:
    BF16  2 B/param
    FP8   1 B/param + float32 scale per 128x128 block: 4 * ceil(out/128) * ceil(in/128)
    INT4  packed int32 [out, in/8] (0.5 B/param) + bf16 scale [out, ceil(in/G)] + int32 weight_shape [2]

Memory per GPU (all in GiB = 2**30 bytes):
    weights_per_gpu = checkpoint_bytes / tp                   (weight_split="even")
    kv_room         = gpu_mem * mem_fraction - weights_per_gpu - overhead
    kv_tokens       = replicas * kv_room / kv_bytes_per_token_per_gpu
    concurrency     = floor(kv_tokens / context)

KV cache per token per layer: MLA caches one latent of kv_lora_rank + qk_rope_head_dim elements
(576): 1152 B in BF16, 576 B in FP8 (per-tensor scale). GLM's DSA attention stores FP8 in
FlashMLA's sparse layout: 512 e4m3 + 4 float32 tile scales + 64 bf16 rope = 656 B; and its
lightning indexer caches an FP8 key of index_head_dim plus a float32 scale (132 B), kept FP8
whatever the latent's dtype. The latent is replicated on every TP rank (MLA has one KV head).

The KV arithmetic is quantkit.planner.kv, the published figures quantkit.planner.article, what
`quantkit plan` prints quantkit.planner.render. See docs/planner.md for the derivations and the
comparison with the published figures.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import ConfigError
from quantkit.model.arch import ModelArch, arch_from_config, load_preset, preset_names
from quantkit.model.inventory import (
    FP8_BLOCK,
    TensorSpec,
    bytes_bf16,
    bytes_f32,
    bytes_fp8_block,
    bytes_int4_group,
    layer_of,
    tensor_inventory,
    vision_params,
)
from quantkit.model.tensors import TensorClass
from quantkit.planner.article import ARTICLE_FIGURES, Comparison, compare_to_article  # noqa: F401  (ARTICLE_FIGURES: the planner's API)
from quantkit.planner.gpus import GPUS
from quantkit.planner.kv import KVCapacity, indexer_cache_layers, kv_capacity, kv_dtype_names, kv_per_token
from quantkit.planner.render import (  # noqa: F401  (capacity_beside_delta, render_plan: the planner's API, beside plan)
    capacity_beside_delta,
    plan_html,
    plan_markdown,
    plan_sections,
    plan_tables,
    render_plan,
)
from quantkit.runtime.units import GB, GiB

KINDS = ("source", "bf16", "prefill", "decode", "int4-bf16")


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


def _matches(module: str, patterns: list[str]) -> bool:
    """compressed-tensors / HF style: "re:<regex>" (re.match) or a plain module name or suffix."""
    for pat in patterns:
        if pat.startswith("re:"):
            if re.match(pat[3:], module):
                return True
        elif module == pat or module.endswith("." + pat):
            return True
    return False


@dataclass(frozen=True)
class Format:
    """Storage rule for one checkpoint kind: which tensors go FP8 block, which INT4, the rest BF16."""

    kind: str
    description: str
    experts: str  # "bf16" | "fp8" | "int4"
    linears: str  # "bf16" | "fp8": the other quantizable Linears
    group_size: int = 128
    bf16_roles: tuple[str, ...] = ()  # Linears kept BF16 in an FP8 format
    not_converted: tuple[str, ...] = ()  # the source's modules_to_not_convert patterns

    def bytes(self, s: TensorSpec) -> int:
        if s.role == "e_score_correction_bias":
            return bytes_f32(s)
        if not s.linear:
            return bytes_bf16(s)  # embeddings, head, norms, router weight, vision
        if s.klass == TensorClass.ROUTED_EXPERT:
            if self.experts == "int4":
                return bytes_int4_group(s, self.group_size)
            return bytes_fp8_block(s) if self.experts == "fp8" else bytes_bf16(s)
        keep = s.role in self.bf16_roles or _matches(_module(s.name), list(self.not_converted))
        return bytes_fp8_block(s) if self.linears == "fp8" and not keep else bytes_bf16(s)


# The projections FP8 formats keep in BF16 regardless of model.
_FP8_KEEP_BF16 = ("weights_proj", "eh_proj")


def formats(arch: ModelArch, *, group_size: int, prefill_bf16_projs: tuple[str, ...]) -> dict[str, Format]:
    """The five checkpoint kinds for one architecture."""
    keep = _FP8_KEEP_BF16 + tuple(prefill_bf16_projs)
    fp8 = f"FP8 e4m3 block {FP8_BLOCK}x{FP8_BLOCK} + f32 scales"
    out = {
        "bf16": Format("bf16", "all BF16 (router bias F32)", "bf16", "bf16"),
        "prefill": Format("prefill", f"{fp8}; BF16: {', '.join(keep)}, embed, head, norms, router", "fp8", "fp8", bf16_roles=keep),
        "decode": Format("decode", f"experts INT4 sym g{group_size}; rest as prefill", "int4", "fp8", group_size, keep),
        "int4-bf16": Format("int4-bf16", f"experts INT4 sym g{group_size}; rest BF16", "int4", "bf16", group_size),
    }
    out["source"] = source_format(arch)
    return {k: out[k] for k in KINDS}


def source_format(arch: ModelArch) -> Format:
    """The published checkpoint's format, from its quantization_config."""
    q = arch.quantization_config or {}
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
        if list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise ConfigError(f"quantization_config: weight_block_size {block} is not supported ({FP8_BLOCK}x{FP8_BLOCK})")
        skip = tuple(q.get("modules_to_not_convert") or ())
        return Format("source", "as published: FP8 block 128 + BF16 modules_to_not_convert", "fp8", "fp8", not_converted=skip)
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            w = group.get("weights") or {}
            if w.get("num_bits") == 4 and w.get("strategy") == "group":
                g = int(w["group_size"])
                return Format("source", f"as published: experts INT4 sym g{g} (compressed-tensors); rest BF16", "int4", "bf16", g)
        raise ConfigError("quantization_config: compressed-tensors without a 4-bit group scheme is not supported by the planner")
    if method is None:
        return Format("source", "as published: BF16", "bf16", "bf16")
    raise ConfigError(f"quantization_config: quant_method {method!r} is not supported by the planner (fp8, compressed-tensors)")


# ----------------------------------------------------------------------------- the plan


@dataclass
class CheckpointPlan:
    kind: str
    description: str
    total_bytes: int
    bytes_by_class: dict[str, int]
    weights_gib_per_gpu: float
    fits: bool
    reason: str
    kv: dict[str, KVCapacity]

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB


@dataclass
class Plan:
    model: str
    family: str
    gpus: int
    gpu: str
    gpu_mem_gib: float
    tp: int
    context: int
    params_by_class: dict[str, int]
    params_total: int  # everything in the checkpoint, MTP and vision included
    params_mtp: int
    params_vision: int
    params_active: int  # per token: non-expert + top-k routed experts; input embedding, MTP and vision excluded
    kv_layers: int
    kv_bytes_per_layer: dict[str, dict[str, int]]  # dtype -> {"latent": B, "indexer": B}
    checkpoints: dict[str, CheckpointPlan]
    assumptions: dict[str, dict[str, Any]]  # option -> {"value", "meaning"}
    notes: list[str] = field(default_factory=list)
    article: list[Comparison] = field(default_factory=list)
    # the planned layout against check-serving's per-rank kernel rules (quantkit.planner.layouts)
    serving: dict[str, Any] = field(default_factory=dict)

    @property
    def params_text(self) -> int:
        return self.params_total - self.params_vision

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["params_text"] = self.params_text
        for kind, ck in self.checkpoints.items():
            d["checkpoints"][kind]["total_gb"] = ck.total_gb
            d["checkpoints"][kind]["total_gib"] = ck.total_gib
        return d

    # -- display: one list of sections (quantkit.planner.render), rendered as rich, markdown or html

    def sections(self) -> list[tuple[str, list[str], list[list[str]]]]:
        return plan_sections(self)

    def to_table(self) -> list[Any]:
        """rich Tables, one per section."""
        return plan_tables(self)

    def _repr_markdown_(self) -> str:
        return plan_markdown(self)

    def _repr_html_(self) -> str:
        return plan_html(self)


# ----------------------------------------------------------------------------- plan()


def recipe_group_size(name: str, arch: ModelArch) -> int:
    """The group size `quantkit convert` would write for this model (its family's recipe), so that a
    plan's decode figure is the checkpoint convert produces: a fixed 128 planned Kimi's decode at
    539 GB while convert writes group 32 (587 GB)."""
    from quantkit.recipe import default_recipe

    try:
        return default_recipe(name if name.startswith("tiny:") else "", arch).group_size
    except ConfigError:  # a family with no shipped recipe: the Marlin default
        return 128


def _resolve_model(model: str | Path | dict) -> tuple[str, ModelArch]:
    """(the name the plan shows, the architecture): a preset's name, or the folder's name unless its config
    is a preset's (quantkit.planner.target.resolve_target reads `model`)."""
    from quantkit.planner.target import resolve_target

    t = resolve_target(model, headers=False)
    if t.preset or isinstance(model, dict):
        return t.preset or "config", t.arch
    path = Path(model)
    return _preset_of(t.arch) or (path.parent if path.name == "config.json" else path).name, t.arch


def _preset_of(arch: ModelArch) -> str | None:
    """The preset with the same architecture, so a downloaded config.json gets the preset's comparisons."""
    def key(a: ModelArch) -> dict[str, Any]:
        d = a.to_json()
        d.pop("quantization_config")
        return d

    for name in preset_names():
        if key(arch_from_config(load_preset(name), source=name)) == key(arch):
            return name
    return None


@dataclass(frozen=True)
class _Setup:
    """plan()'s options, checked, with the model-dependent defaults resolved."""

    gpus: int
    gpu: str
    mem: float  # GiB per GPU
    custom_mem: bool  # gpu_mem_gib given (else the GPUS entry's)
    tp: int
    context: int
    mem_fraction: float
    overhead_gib: float
    group_size: int
    dtypes: list[str]
    weight_split: str
    kv_replicated: bool
    indexer_cache: str
    include_mtp_kv: bool
    mtp_embed_copies: bool
    prefill_bf16_projs: tuple[str, ...]
    vision_n: int  # vision tower parameters

    @property
    def replicas(self) -> int:
        return self.gpus // self.tp

    @property
    def budget(self) -> float:
        """GiB per GPU for weights + KV pool, the overhead taken off."""
        return self.mem * self.mem_fraction - self.overhead_gib


def _check_options(*, gpus: int, tp: int, weight_split: str, indexer_cache: str, mem_fraction: float,
                   group_size: int, context: int) -> None:
    if tp < 1 or gpus < 1 or gpus % tp:
        raise ConfigError(f"gpus={gpus} must be a positive multiple of tp={tp}")
    if weight_split not in ("even", "replicate-small"):
        raise ConfigError(f"weight_split {weight_split!r}: use 'even' or 'replicate-small'")
    if indexer_cache not in ("all", "owners"):
        raise ConfigError(f"indexer_cache {indexer_cache!r}: use 'all' or 'owners'")
    if not 0 < mem_fraction <= 1:
        raise ConfigError(f"mem_fraction {mem_fraction} must be in (0, 1]")
    if group_size < 8 or group_size % 8:
        raise ConfigError(f"group_size {group_size} must be a positive multiple of 8")
    if context < 1:
        raise ConfigError(f"context {context} must be positive")


def _vision_n(arch: ModelArch, vision_bytes: int | None) -> int:
    """Vision tower parameters (a family with one: Kimi K2.5/K2.6): from vision_config, or BF16 `vision_bytes`."""
    if not arch.definition.vision:
        return 0
    return vision_bytes // 2 if vision_bytes is not None else vision_params(arch.raw)


def _params_by_class(specs: list[TensorSpec]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in specs:
        out[s.klass.value] = out.get(s.klass.value, 0) + s.params
    return out


def _active_params(arch: ModelArch, specs: list[TensorSpec]) -> int:
    """Active per token: every matmul weight a token passes through, i.e. all but the routed experts
    it is not sent to, the input embedding (a row lookup), MTP and vision."""
    expert_layer = sum(s.params for s in specs if s.klass == TensorClass.ROUTED_EXPERT) // max(
        sum(arch.is_moe(i) for i in range(arch.num_layers_with_mtp)), 1
    )
    skip = (TensorClass.ROUTED_EXPERT, TensorClass.VISION, TensorClass.EMBEDDING)
    active = sum(s.params for s in specs if s.klass not in skip and 0 <= layer_of(s.name) < arch.num_hidden_layers)
    active += sum(s.params for s in specs if s.klass == TensorClass.HEAD or s.name == f"{arch.prefix}norm.weight")
    return active + sum(arch.moe_layers) * expert_layer * arch.num_experts_per_tok // arch.n_routed_experts


def _bytes_by_class(fmt: Format, specs: list[TensorSpec], replicate_small: bool) -> tuple[dict[str, int], int, int]:
    """(bytes per tensor class, bytes split over the TP ranks, bytes every rank holds whole)."""
    by_class: dict[str, int] = {}
    split = repl = 0
    for s in specs:
        b = fmt.bytes(s)
        by_class[s.klass.value] = by_class.get(s.klass.value, 0) + b
        if replicate_small and s.replicated:
            repl += b
        else:
            split += b
    return by_class, split, repl


def _checkpoint(kind: str, fmt: Format, specs: list[TensorSpec], kv_info: dict[str, dict[str, int]], o: _Setup) -> CheckpointPlan:
    """One checkpoint kind: its bytes, weights per GPU, the KV pool beside them and whether it serves."""
    by_class, split, repl = _bytes_by_class(fmt, specs, o.weight_split == "replicate-small")
    w_gpu = (split / o.tp + repl) / GiB
    room = o.budget - w_gpu
    kv = kv_capacity(kv_info, room, tp=o.tp, replicas=o.replicas, kv_replicated=o.kv_replicated, context=o.context)
    if room <= 0:
        fits, reason = False, (
            f"does not fit: {w_gpu:.1f} GiB weights + {o.overhead_gib:g} GiB overhead per GPU > "
            f"{o.mem_fraction:g} x {o.mem:g} GiB = {o.mem * o.mem_fraction:.1f} GiB"
        )
    elif max(kv[d].tokens for d in o.dtypes) // o.replicas < o.context:
        fits, reason = False, f"weights fit, but KV room {room:.1f} GiB/GPU holds fewer than {o.context:,} tokens"
    else:
        fits, reason = True, ""
    return CheckpointPlan(kind, fmt.description, split + repl, by_class, round(w_gpu, 3), fits, reason, kv)


def _assumptions(o: _Setup) -> dict[str, dict[str, Any]]:
    gpu_note = GPUS[o.gpu].note if o.gpu in GPUS and not o.custom_mem else "custom memory size"
    return {
        "gpus": {"value": o.gpus, "meaning": "GPUs in the set"},
        "gpu": {"value": o.gpu, "meaning": gpu_note},
        "gpu_mem_gib": {"value": o.mem, "meaning": "memory per GPU, GiB, as the driver reports it"},
        "tp": {"value": o.tp, "meaning": f"tensor-parallel size; {o.replicas} replica(s)"},
        "context": {"value": o.context, "meaning": "tokens per request for concurrency (article: 686K / 32 = 21.4K)"},
        "mem_fraction": {"value": o.mem_fraction, "meaning": "share of GPU memory for weights + KV pool"},
        "overhead_gib": {"value": o.overhead_gib, "meaning": "per-GPU runtime overhead (activations, graphs, NCCL)"},
        "group_size": {"value": o.group_size, "meaning": "INT4 group of decode / int4-bf16 experts (bf16 scale per group)"},
        "kv_dtypes": {"value": ",".join(o.dtypes), "meaning": "KV dtypes sized"},
        "weight_split": {"value": o.weight_split, "meaning": "even: bytes / tp on every rank; replicate-small: small tensors whole on each rank"},
        "kv_replicated": {"value": o.kv_replicated, "meaning": "MLA latent on every TP rank (no DP attention); key/value heads split over the ranks"},
        "indexer_cache": {"value": o.indexer_cache, "meaning": "DSA indexer key cache (FP8 + f32 scale) on all layers or only owners"},
        "include_mtp_kv": {"value": o.include_mtp_kv, "meaning": "KV for MTP layers (speculative decoding)"},
        "vision_bytes": {"value": o.vision_n * 2, "meaning": "vision tower + projector, BF16, on every checkpoint"},
        "mtp_embed_copies": {"value": o.mtp_embed_copies, "meaning": "MTP layer stores its own embed_tokens + shared_head.head"},
        "prefill_bf16_projs": {"value": ",".join(o.prefill_bf16_projs) or "-", "meaning": "attention projections FP8 kinds keep BF16"},
    }


def _notes(arch: ModelArch, src: Format, o: _Setup, idx_layers: int) -> list[str]:
    notes = []
    if o.group_size not in (32, 64, 128):
        notes.append(f"group_size {o.group_size}: Marlin MoE kernels take 32, 64 or 128")
    if src.experts == "int4" and src.group_size != o.group_size:
        notes.append(
            f"source experts are INT4 g{src.group_size}; decode at g{o.group_size} re-quantizes them "
            f"(pass group_size={src.group_size} to reuse them bit for bit)"
        )
    if arch.has_dsa:
        notes.append(
            f"DSA: {sum(arch.indexer_layers)} of {arch.num_hidden_layers} layers own an indexer; "
            f"indexer key cache sized on {idx_layers} layers ({o.indexer_cache})"
        )
    return notes


def plan(
    model: str | Path | dict,
    *,
    gpus: int = 8,
    gpu: str = "h200",
    tp: int | None = None,
    context: int = 21_400,
    mem_fraction: float = 0.90,
    overhead_gib: float = 12.0,
    group_size: int | None = None,
    kv_dtypes: tuple[str, ...] = ("bf16", "fp8"),
    gpu_mem_gib: float | None = None,
    weight_split: str = "even",
    kv_replicated: bool = True,
    indexer_cache: str = "all",
    include_mtp_kv: bool = False,
    vision_bytes: int | None = None,
    mtp_embed_copies: bool | None = None,
    prefill_bf16_projs: tuple[str, ...] | None = None,
) -> Plan:
    """Checkpoint sizes, weight memory per GPU and KV capacity for one model on one GPU set.

    Args:
        model: a preset name (see `preset_names()`), a folder holding config.json, or a config dict.
        gpus: GPUs in the set; `gpus // tp` replicas of the model.
        gpu: a key of GPUS (memory in GiB as the driver reports it); `gpu_mem_gib` overrides it.
        tp: tensor-parallel size; defaults to `gpus`.
        context: tokens per request for the concurrency figure (21,400: the article's 686K / 32).
        mem_fraction: share of GPU memory the engine may use for weights + KV (SGLang mem_fraction_static).
        overhead_gib: activations, CUDA graphs, NCCL buffers per GPU.
        group_size: INT4 group for the decode and int4-bf16 kinds; None means the model's recipe's
            (what `quantkit convert` writes: Kimi 32, GLM and DeepSeek 128).
        kv_dtypes: KV cache dtypes to size ("bf16", "fp8").
        weight_split: "even" divides every byte by tp; "replicate-small" keeps norms, router,
            q_a/kv_a, the indexer, MTP eh_proj and vision whole on every rank.
        kv_replicated: the MLA latent sits on every TP rank (True); False models DP attention.
        indexer_cache: "all" sizes the DSA indexer key cache on every layer, "owners" only on the
            layers that own an indexer.
        include_mtp_kv: also cache KV for the MTP layer(s) (speculative decoding on).
        vision_bytes: bytes of the vision tower; None computes it from vision_config.
        mtp_embed_copies: the MTP layer stores its own embed_tokens and shared_head.head; None means
            the family definition's (yes for DeepSeek-V3, whose published checkpoint does).
        prefill_bf16_projs: attention projections the FP8 kinds keep BF16; None means the family
            definition's (q_a_proj + kv_a_proj_with_mqa for Kimi, none otherwise).

    Returns:
        A Plan; `render_plan(plan, console)` prints it, `plan.to_json()` serialises it.

    Example:
        >>> p = plan("glm-5.2")
        >>> round(p.checkpoints["source"].weights_gib_per_gpu)
        88
    """
    name, arch = _resolve_model(model)
    if group_size is None:
        group_size = recipe_group_size(name, arch)
    if gpu not in GPUS and gpu_mem_gib is None:
        raise ConfigError(f"unknown gpu {gpu!r}; known: {', '.join(GPUS)} (or pass gpu_mem_gib)")
    mem = float(gpu_mem_gib if gpu_mem_gib is not None else GPUS[gpu].mem_gib)
    tp = gpus if tp is None else tp
    _check_options(gpus=gpus, tp=tp, weight_split=weight_split, indexer_cache=indexer_cache, mem_fraction=mem_fraction,
                   group_size=group_size, context=context)
    if prefill_bf16_projs is None:
        prefill_bf16_projs = arch.definition.prefill_bf16_projections
    o = _Setup(
        gpus=gpus, gpu=gpu, mem=mem, custom_mem=gpu_mem_gib is not None, tp=tp, context=context,
        mem_fraction=mem_fraction, overhead_gib=overhead_gib, group_size=group_size, dtypes=kv_dtype_names(kv_dtypes), weight_split=weight_split, kv_replicated=kv_replicated,
        indexer_cache=indexer_cache, include_mtp_kv=include_mtp_kv,
        mtp_embed_copies=arch.definition.mtp_embed_copies if mtp_embed_copies is None else mtp_embed_copies,
        prefill_bf16_projs=tuple(prefill_bf16_projs), vision_n=_vision_n(arch, vision_bytes),
    )
    specs = tensor_inventory(arch, vision_params=o.vision_n, mtp_embed_copies=o.mtp_embed_copies)
    params_by_class = _params_by_class(specs)
    kv_layers = arch.num_hidden_layers + (arch.num_mtp_layers if include_mtp_kv else 0)
    idx_layers = indexer_cache_layers(arch, kv_layers, indexer_cache)
    kv_info = kv_per_token(arch, o.dtypes, kv_layers, idx_layers)
    fmts = formats(arch, group_size=group_size, prefill_bf16_projs=o.prefill_bf16_projs)
    result = Plan(
        model=name,
        family=arch.family,
        gpus=gpus,
        gpu=gpu,
        gpu_mem_gib=o.mem,
        tp=tp,
        context=context,
        params_by_class=params_by_class,
        params_total=sum(params_by_class.values()),
        params_mtp=sum(s.params for s in specs if layer_of(s.name) >= arch.num_hidden_layers),
        params_vision=o.vision_n,
        params_active=_active_params(arch, specs),
        kv_layers=kv_layers,
        kv_bytes_per_layer=kv_info,
        checkpoints={kind: _checkpoint(kind, fmt, specs, kv_info, o) for kind, fmt in fmts.items()},
        assumptions=_assumptions(o),
        notes=_notes(arch, fmts["source"], o, idx_layers),
    )
    result.article = compare_to_article(result)
    _check_serving_layout(result, model, o)
    return result


def _check_serving_layout(result: Plan, model: str | Path | dict, o: _Setup) -> None:
    """Only a layout whose shards pass the engines' kernel rules is recommended (a note says which)."""
    from quantkit.planner.layouts import layout_note, raw_config, serving_layouts

    result.serving = serving_layouts(raw_config(model), tp=o.tp, gpu=o.gpu, group_size=o.group_size,
                                     bf16_projs=o.prefill_bf16_projs, dp_attention=not o.kv_replicated)
    if note := layout_note(result.serving):
        result.notes.append(note)


if __name__ == "__main__":  # python -m quantkit.planner.capacity [preset]
    import sys

    from rich.console import Console

    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["kimi-k2.6", "glm-5.2"]
    for m in names:
        if "--json" in sys.argv:
            print(json.dumps(plan(m).to_json(), indent=1))
        else:
            render_plan(plan(m), Console(width=200))
