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

See docs/planner.md for the derivations and the comparison with the published figures.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import ConfigError
from quantkit.model.arch import ModelArch, arch_from_config, load_arch, load_preset, preset_names
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
from quantkit.planner.gpus import GPUS

GiB = 2**30
GB = 10**9

KINDS = ("source", "bf16", "prefill", "decode", "int4-bf16")
KV_DTYPES = {"bf16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}



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


# ----------------------------------------------------------------------------- kv cache


def kv_bytes_per_layer(arch: ModelArch, kv_dtype: str, *, indexer: bool) -> int:
    """Bytes cached per token for one layer: the MLA latent (+ the DSA indexer key if `indexer`)."""
    if kv_dtype == "bf16":
        latent = 2 * arch.kv_cache_width
    elif arch.has_dsa:  # FlashMLA sparse FP8: e4m3 nope latent + f32 scale per 128 + bf16 rope
        latent = arch.kv_lora_rank + 4 * math.ceil(arch.kv_lora_rank / 128) + 2 * arch.qk_rope_head_dim
    else:  # e4m3 latent, one static per-tensor scale
        latent = arch.kv_cache_width
    return latent + (arch.index_head_dim + 4 if indexer else 0)


# ----------------------------------------------------------------------------- the plan


@dataclass
class KVCapacity:
    kv_dtype: str
    bytes_per_token: int  # all cached layers, one copy
    kv_gib_per_gpu: float  # room left for the KV pool on each GPU
    tokens: int  # whole GPU set
    concurrent_requests: int  # at `context` tokens each


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
class Comparison:
    figure: str
    unit: str
    article: float
    quantkit: float
    ratio: float  # quantkit / article
    source: str


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

    # -- display: one list of sections, rendered as rich, markdown or html

    def sections(self) -> list[tuple[str, list[str], list[list[str]]]]:
        gib = lambda b: f"{b / GiB:,.1f}"  # noqa: E731
        kvd = list(next(iter(self.checkpoints.values())).kv)
        setup = f"{self.gpus}x {self.gpu} ({self.gpu_mem_gib} GiB), TP{self.tp}, context {self.context:,}"
        rows = [
            [
                ck.kind,
                f"{ck.total_gb:,.1f}",
                gib(ck.total_bytes),
                f"{ck.weights_gib_per_gpu:,.1f}",
                "yes" if ck.fits else "NO",
                *[_tokens(ck.kv[d].tokens) for d in kvd],
                *[f"{ck.kv[d].concurrent_requests}" for d in kvd],
            ]
            for ck in self.checkpoints.values()
        ]
        ckpt = (
            f"{self.model}: checkpoints on {setup}",
            ["kind", "GB", "GiB", "GiB/GPU", "fits", *[f"KV {d}" for d in kvd], *[f"req {d}" for d in kvd]],
            rows,
        )
        # the long text goes in its own two-column table, so the numbers fit an 80-column terminal
        kinds = (
            "checkpoint kinds",
            ["kind", "format / reason"],
            [[ck.kind, ck.reason if not ck.fits else ck.description] for ck in self.checkpoints.values()],
        )
        classes = sorted({c for ck in self.checkpoints.values() for c in ck.bytes_by_class}, key=[c.value for c in TensorClass].index)
        by_class = (
            "bytes by tensor class (GiB)",
            ["class", "params (B)", *self.checkpoints],
            [[c, f"{self.params_by_class.get(c, 0) / 1e9:,.3f}", *[gib(ck.bytes_by_class.get(c, 0)) for ck in self.checkpoints.values()]] for c in classes]
            + [["total", f"{self.params_total / 1e9:,.3f}", *[gib(ck.total_bytes) for ck in self.checkpoints.values()]]],
        )
        kv = (
            f"KV cache per token ({self.kv_layers} layers)",
            ["dtype", "latent B/layer", "indexer B/layer", "B/token"],
            [[d, str(v["latent"]), str(v["indexer_avg"]), f"{v['per_token']:,}"] for d, v in self.kv_bytes_per_layer.items()],
        )
        params = (
            "parameters",
            ["total", "text", "MTP", "vision", "active/token"],
            [[f"{x / 1e9:,.2f}B" for x in (self.params_total, self.params_text, self.params_mtp, self.params_vision, self.params_active)]],
        )
        out = [params, ckpt, kinds, by_class, kv]
        if self.article:
            out.append(
                (
                    "quantkit vs published figures (ratio = quantkit / published)",
                    ["figure", "unit", "published", "quantkit", "ratio", "source"],
                    [[c.figure, c.unit, _fmt(c.article, c.unit), _fmt(c.quantkit, c.unit), f"{c.ratio:.3f}", c.source] for c in self.article],
                )
            )
        out.append(("assumptions (keyword options of plan())", ["option", "value", "meaning"], [[k, str(v["value"]), v["meaning"]] for k, v in self.assumptions.items()]))
        if self.notes:
            out.append(("notes", ["note"], [[n] for n in self.notes]))
        return out

    def to_table(self) -> list[Any]:
        """rich Tables, one per section."""
        from rich.table import Table

        tables = []
        for title, headers, rows in self.sections():
            t = Table(title=title, title_justify="left")
            for hdr in headers:
                t.add_column(hdr, overflow="fold", no_wrap=hdr in ("kind", "class"), justify="left" if hdr in ("kind", "class", "figure", "option", "meaning", "note", "format / reason", "source", "dtype") else "right")
            for r in rows:
                t.add_row(*r, style="bold red" if "fits" in headers and r[headers.index("fits")] == "NO" else None)
            tables.append(t)
        return tables

    def _repr_markdown_(self) -> str:
        parts = []
        for title, headers, rows in self.sections():
            esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
            lines = [f"**{title}**", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
            parts.append("\n".join(lines))
        return "\n\n".join(parts)

    def _repr_html_(self) -> str:
        parts = []
        for title, headers, rows in self.sections():
            th = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
            trs = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
            parts.append(f"<table><caption style='text-align:left'><b>{html.escape(title)}</b></caption><tr>{th}</tr>{trs}</table>")
        return "\n".join(parts)


def _fmt(x: float, unit: str) -> str:
    if unit == "params":
        return f"{x / 1e9:,.2f}B"
    if unit in ("tokens", "requests"):
        return f"{x:,.0f}"
    return f"{x:,.1f}"


def _tokens(n: int) -> str:
    """689K / 1.38M: compact enough for an 80-column terminal (exact counts are in --json)."""
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K" if n >= 1e3 else str(n)


def render_plan(plan: Plan, console: Any) -> None:
    """Print every section of a Plan on a rich Console."""
    for table in plan.to_table():
        console.print(table)


# ----------------------------------------------------------------------------- published figures

# Figures from the serving-economics article (Cloudflare's production notes on Kimi K2.6 and
# GLM 5.2) and the facts sheet, with the unit each one is really in, and the plan() setup and
# checkpoint kind that reproduce it. The article writes "GB" throughout, but its 705 / 88 for GLM
# FP8 match the checkpoint in GiB (755.6 GB = 703.7 GiB), while 421 / 52 for INT4 match in GB.
@dataclass(frozen=True)
class Figure:
    key: str
    model: str  # preset name
    description: str
    value: float
    unit: str  # "GB", "GiB", "tokens", "requests", "params"
    metric: str  # see _metric
    kind: str = ""  # checkpoint kind
    kv_dtype: str = ""
    setup: bool = False  # depends on the 8xH200 TP8 setup (and the default options)
    source: str = "article"


ARTICLE_FIGURES: tuple[Figure, ...] = (
    Figure("glm_params", "glm-5.2", "GLM 5.2 total params (no MTP)", 744e9, "params", "params_no_mtp"),
    Figure("glm_fp8_total", "glm-5.2", "GLM 5.2 FP8 checkpoint", 705, "GiB", "total", "source"),
    Figure("glm_fp8_gpu", "glm-5.2", "GLM 5.2 FP8 per GPU, TP8", 88, "GiB", "per_gpu", "source", setup=True),
    Figure("glm_int4_total", "glm-5.2", "GLM 5.2 INT4 checkpoint", 421, "GB", "total", "int4-bf16"),
    Figure("glm_int4_gpu", "glm-5.2", "GLM 5.2 INT4 per GPU, TP8", 52, "GB", "per_gpu", "int4-bf16", setup=True),
    Figure("glm_fp8_total_fs", "glm-5.2", "GLM-5.2-FP8 on disk", 755.6, "GB", "total", "source", source="facts sheet"),
    Figure("kimi_params", "kimi-k2.6", "Kimi K2.6 total params", 1e12, "params", "params_total"),
    Figure("kimi_active", "kimi-k2.6", "Kimi K2.6 active params", 32e9, "params", "params_active"),
    Figure("glm_active", "glm-5.2", "GLM 5.2 active params", 40e9, "params", "params_active"),
    Figure("kimi_int4_total", "kimi-k2.6", "Kimi K2.6 INT4 (published) checkpoint", 595, "GB", "total", "source", source="facts sheet"),
    Figure("kimi_fp8_total", "kimi-k2.6", "Kimi K2.6 FP8 checkpoint", 1030, "GB", "total", "prefill", source="facts sheet"),
    Figure("kimi_kv_bf16", "kimi-k2.6", "Kimi K2.6 KV capacity BF16, 8xH200", 686e3, "tokens", "kv_tokens", "source", "bf16", True),
    Figure("kimi_kv_fp8", "kimi-k2.6", "Kimi K2.6 KV capacity FP8, 8xH200", 1.37e6, "tokens", "kv_tokens", "source", "fp8", True),
    Figure("kimi_req_bf16", "kimi-k2.6", "Kimi K2.6 concurrency BF16 KV", 32, "requests", "requests", "source", "bf16", True),
    Figure("kimi_req_fp8", "kimi-k2.6", "Kimi K2.6 concurrency FP8 KV", 64, "requests", "requests", "source", "fp8", True),
)

ARTICLE_SETUP = {"gpus": 8, "gpu": "h200", "tp": 8}
_UNITS = {"GB": GB, "GiB": GiB}


def _metric(plan: Plan, f: Figure) -> float:
    if f.metric == "params_total":
        return plan.params_total
    if f.metric == "params_no_mtp":
        return plan.params_total - plan.params_mtp - plan.params_vision
    if f.metric == "params_active":
        return plan.params_active
    ck = plan.checkpoints[f.kind]
    if f.metric == "total":
        return ck.total_bytes / _UNITS[f.unit]
    if f.metric == "per_gpu":
        return ck.weights_gib_per_gpu * GiB / _UNITS[f.unit]
    if f.metric == "kv_tokens":
        return ck.kv[f.kv_dtype].tokens
    if f.metric == "requests":
        return ck.kv[f.kv_dtype].concurrent_requests
    raise ValueError(f"unknown metric {f.metric!r}")


def compare_to_article(plan: Plan, preset: str | None = None) -> list[Comparison]:
    """quantkit's value / the published one for each figure of this model that the plan's setup reproduces."""
    preset = preset or plan.model
    same_setup = plan.gpus == ARTICLE_SETUP["gpus"] and plan.gpu == ARTICLE_SETUP["gpu"] and plan.tp == ARTICLE_SETUP["tp"]
    out = []
    for f in ARTICLE_FIGURES:
        if f.model != preset or (f.setup and not same_setup):
            continue
        if f.kind and f.kind not in plan.checkpoints or f.kv_dtype and f.kv_dtype not in next(iter(plan.checkpoints.values())).kv:
            continue
        q = _metric(plan, f)
        out.append(Comparison(f.description, f.unit, f.value, q, q / f.value, f.source))
    return out


# ----------------------------------------------------------------------------- plan()


def _resolve_model(model: str | Path | dict) -> tuple[str, ModelArch]:
    if isinstance(model, dict):
        return "config", arch_from_config(model, source="config dict")
    path = Path(model)
    if isinstance(model, Path) or path.is_dir() or "/" in str(model) or str(model).endswith(".json"):
        if path.is_file() and path.name == "config.json":
            path = path.parent
        arch = load_arch(path)
        return _preset_of(arch) or path.name, arch
    name = str(model)
    return name, arch_from_config(load_preset(name), source=f"preset {name}")


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


def plan(
    model: str | Path | dict,
    *,
    gpus: int = 8,
    gpu: str = "h200",
    tp: int | None = None,
    context: int = 21_400,
    mem_fraction: float = 0.90,
    overhead_gib: float = 12.0,
    group_size: int = 128,
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
        group_size: INT4 group for the decode and int4-bf16 kinds (Kimi's published experts use 32).
        kv_dtypes: KV cache dtypes to size ("bf16", "fp8").
        weight_split: "even" divides every byte by tp; "replicate-small" keeps norms, router,
            q_a/kv_a, the indexer, MTP eh_proj and vision whole on every rank.
        kv_replicated: the MLA latent sits on every TP rank (True); False models DP attention.
        indexer_cache: "all" sizes the DSA indexer key cache on every layer, "owners" only on the
            layers that own an indexer.
        include_mtp_kv: also cache KV for the MTP layer(s) (speculative decoding on).
        vision_bytes: bytes of the vision tower; None computes it from vision_config.
        mtp_embed_copies: the MTP layer stores its own embed_tokens and shared_head.head; None means
            yes for DeepSeek-V3 (its published checkpoint does), no otherwise.
        prefill_bf16_projs: attention projections the FP8 kinds keep BF16; None means
            q_a_proj + kv_a_proj_with_mqa for Kimi, none otherwise.

    Returns:
        A Plan; `render_plan(plan, console)` prints it, `plan.to_json()` serialises it.

    Example:
        >>> p = plan("glm-5.2")
        >>> round(p.checkpoints["source"].weights_gib_per_gpu)
        88
    """
    name, arch = _resolve_model(model)
    if gpu not in GPUS and gpu_mem_gib is None:
        raise ConfigError(f"unknown gpu {gpu!r}; known: {', '.join(GPUS)} (or pass gpu_mem_gib)")
    mem = float(gpu_mem_gib if gpu_mem_gib is not None else GPUS[gpu].mem_gib)
    tp = gpus if tp is None else tp
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
    try:
        dtypes = [KV_DTYPES[d] for d in kv_dtypes]
    except KeyError as e:
        raise ConfigError(f"kv dtype {e.args[0]!r}: use one of {', '.join(KV_DTYPES)}") from None
    if mtp_embed_copies is None:
        mtp_embed_copies = arch.family == "deepseek_v3"
    if prefill_bf16_projs is None:
        prefill_bf16_projs = ("q_a_proj", "kv_a_proj_with_mqa") if arch.family == "kimi" else ()

    # -- tensors and bytes per kind
    vision_n = 0
    if arch.model_type == "kimi_k25":
        vision_n = vision_bytes // 2 if vision_bytes is not None else vision_params(arch.raw)
    specs = tensor_inventory(arch, vision_params=vision_n, mtp_embed_copies=mtp_embed_copies)
    params_by_class: dict[str, int] = {}
    for s in specs:
        params_by_class[s.klass.value] = params_by_class.get(s.klass.value, 0) + s.params
    mtp_params = sum(s.params for s in specs if layer_of(s.name) >= arch.num_hidden_layers)
    expert_layer = sum(s.params for s in specs if s.klass == TensorClass.ROUTED_EXPERT) // max(
        sum(arch.is_moe(i) for i in range(arch.num_layers_with_mtp)), 1
    )
    n_moe_main = sum(arch.moe_layers)
    # Active per token: every matmul weight a token passes through, i.e. all but the routed experts
    # it is not sent to, the input embedding (a row lookup), MTP and vision.
    skip = (TensorClass.ROUTED_EXPERT, TensorClass.VISION, TensorClass.EMBEDDING)
    active = sum(s.params for s in specs if s.klass not in skip and 0 <= layer_of(s.name) < arch.num_hidden_layers)
    active += sum(s.params for s in specs if s.klass == TensorClass.HEAD or s.name == f"{arch.prefix}norm.weight")
    active += n_moe_main * expert_layer * arch.num_experts_per_tok // arch.n_routed_experts

    # -- kv per token
    kv_layers = arch.num_hidden_layers + (arch.num_mtp_layers if include_mtp_kv else 0)
    if arch.has_dsa:
        owners = list(arch.indexer_layers) + [True] * arch.num_mtp_layers
        idx_layers = kv_layers if indexer_cache == "all" else sum(owners[:kv_layers])
    else:
        idx_layers = 0
    kv_info: dict[str, dict[str, int]] = {}
    for d in dtypes:
        latent = kv_bytes_per_layer(arch, d, indexer=False)
        idx = kv_bytes_per_layer(arch, d, indexer=True) - latent if arch.has_dsa else 0
        per_token = latent * kv_layers + idx * idx_layers
        kv_info[d] = {"latent": latent, "indexer": idx, "indexer_layers": idx_layers, "indexer_avg": round(idx * idx_layers / kv_layers), "per_token": per_token}

    # -- per checkpoint kind
    fmts = formats(arch, group_size=group_size, prefill_bf16_projs=tuple(prefill_bf16_projs))
    replicas = gpus // tp
    budget = mem * mem_fraction - overhead_gib
    checkpoints: dict[str, CheckpointPlan] = {}
    for kind, fmt in fmts.items():
        by_class: dict[str, int] = {}
        split = repl = 0
        for s in specs:
            b = fmt.bytes(s)
            by_class[s.klass.value] = by_class.get(s.klass.value, 0) + b
            if weight_split == "replicate-small" and s.replicated:
                repl += b
            else:
                split += b
        total = split + repl
        w_gpu = (split / tp + repl) / GiB
        room = budget - w_gpu
        kv = {}
        for d in dtypes:
            per_gpu = kv_info[d]["per_token"] / (1 if kv_replicated else tp)
            tokens = max(int(room * GiB / per_gpu), 0) * replicas if room > 0 else 0
            kv[d] = KVCapacity(d, kv_info[d]["per_token"], round(room, 3), tokens, tokens // context)
        if room <= 0:
            fits, reason = False, (
                f"does not fit: {w_gpu:.1f} GiB weights + {overhead_gib:g} GiB overhead per GPU > "
                f"{mem_fraction:g} x {mem:g} GiB = {mem * mem_fraction:.1f} GiB"
            )
        elif max(kv[d].tokens for d in dtypes) // replicas < context:
            fits, reason = False, f"weights fit, but KV room {room:.1f} GiB/GPU holds fewer than {context:,} tokens"
        else:
            fits, reason = True, ""
        checkpoints[kind] = CheckpointPlan(kind, fmt.description, total, by_class, round(w_gpu, 3), fits, reason, kv)

    assumptions = {
        "gpus": {"value": gpus, "meaning": "GPUs in the set"},
        "gpu": {"value": gpu, "meaning": GPUS[gpu].note if gpu in GPUS and gpu_mem_gib is None else "custom memory size"},
        "gpu_mem_gib": {"value": mem, "meaning": "memory per GPU, GiB, as the driver reports it"},
        "tp": {"value": tp, "meaning": f"tensor-parallel size; {replicas} replica(s)"},
        "context": {"value": context, "meaning": "tokens per request for concurrency (article: 686K / 32 = 21.4K)"},
        "mem_fraction": {"value": mem_fraction, "meaning": "share of GPU memory for weights + KV pool"},
        "overhead_gib": {"value": overhead_gib, "meaning": "per-GPU runtime overhead (activations, graphs, NCCL)"},
        "group_size": {"value": group_size, "meaning": "INT4 group of decode / int4-bf16 experts (bf16 scale per group)"},
        "kv_dtypes": {"value": ",".join(dtypes), "meaning": "KV dtypes sized"},
        "weight_split": {"value": weight_split, "meaning": "even: bytes / tp on every rank; replicate-small: small tensors whole on each rank"},
        "kv_replicated": {"value": kv_replicated, "meaning": "MLA latent on every TP rank (no DP attention)"},
        "indexer_cache": {"value": indexer_cache, "meaning": "DSA indexer key cache (FP8 + f32 scale) on all layers or only owners"},
        "include_mtp_kv": {"value": include_mtp_kv, "meaning": "KV for MTP layers (speculative decoding)"},
        "vision_bytes": {"value": vision_n * 2, "meaning": "vision tower + projector, BF16, on every checkpoint"},
        "mtp_embed_copies": {"value": mtp_embed_copies, "meaning": "MTP layer stores its own embed_tokens + shared_head.head"},
        "prefill_bf16_projs": {"value": ",".join(prefill_bf16_projs) or "-", "meaning": "attention projections FP8 kinds keep BF16"},
    }
    notes = []
    if group_size not in (32, 64, 128):
        notes.append(f"group_size {group_size}: Marlin MoE kernels take 32, 64 or 128")
    src = fmts["source"]
    if src.experts == "int4" and src.group_size != group_size:
        notes.append(
            f"source experts are INT4 g{src.group_size}; decode at g{group_size} re-quantizes them "
            f"(pass group_size={src.group_size} to reuse them bit for bit)"
        )
    if arch.has_dsa:
        notes.append(
            f"DSA: {sum(arch.indexer_layers)} of {arch.num_hidden_layers} layers own an indexer; "
            f"indexer key cache sized on {idx_layers} layers ({indexer_cache})"
        )
    result = Plan(
        model=name,
        family=arch.family,
        gpus=gpus,
        gpu=gpu,
        gpu_mem_gib=mem,
        tp=tp,
        context=context,
        params_by_class=params_by_class,
        params_total=sum(params_by_class.values()),
        params_mtp=mtp_params,
        params_vision=vision_n,
        params_active=active,
        kv_layers=kv_layers,
        kv_bytes_per_layer=kv_info,
        checkpoints=checkpoints,
        assumptions=assumptions,
        notes=notes,
    )
    result.article = compare_to_article(result)
    return result


# ---- what plan shows ---------------------------------------------------------------------------------
def capacity_beside_delta(plan, validation: dict) -> list[str]:
    """`quantkit plan --validation FILE`: FP8 KV capacity next to the KV delta validate measured,
    e.g. "FP8 KV: 1.58M tokens (2.0x), measured KL +0.0004 (decode + FP8 KV cache, ...)"."""
    kinds = [k for k in ("decode", "source", "int4-bf16") if k in plan.checkpoints and plan.checkpoints[k].fits]
    if not kinds:
        return ["FP8 KV: no checkpoint kind fits this setup"]
    ck = plan.checkpoints[kinds[0]]
    fp8, bf16 = ck.kv["fp8"].tokens, ck.kv["bf16"].tokens
    ratio = f" ({fp8 / bf16:.1f}x)" if bf16 else ""
    kv = validation.get("kv_cache") or {}
    rows = {r: validation.get("rows", {}).get(r) for r in ("decode_kv", "cross_phase_kv")}
    measured = [(r, v) for r, v in rows.items() if v and v["metrics"].get("kv_delta") is not None]
    if kv.get("dtype", "bf16") == "bf16" or not measured:
        return [f"FP8 KV: {_short_tokens(fp8)} tokens{ratio} on {kinds[0]}; not measured: "
                "run `quantkit validate DIR --kv-cache-dtype fp8_e4m3` and pass its validation.json"]
    out = []
    for r, v in measured:
        se = v["kv"].get("kv_delta_se")
        out.append(f"FP8 KV: {_short_tokens(fp8)} tokens{ratio} on {kinds[0]}, measured KL {v['metrics']['kv_delta']:+.2g}"
                   f"{f' (SE {se:.1g})' if se else ''} on {r.replace('_', ' ')} ({kv['dtype']}, "
                   f"{'calibrated scales' if kv.get('calibrated') else 'scale 1.0'}; {validation.get('dir', 'validation.json')})")
    return out


def _short_tokens(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


if __name__ == "__main__":  # python -m quantkit.planner.capacity [preset]
    import sys

    from rich.console import Console

    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["kimi-k2.6", "glm-5.2"]
    for m in names:
        if "--json" in sys.argv:
            print(json.dumps(plan(m).to_json(), indent=1))
        else:
            render_plan(plan(m), Console(width=200))
