"""Will the pair load at the user's parallel layout? Each module's shard per rank, against the rules of
the kernel each engine picks for that GPU.

check-serving's engine run (quantkit.serving.checks) builds every module whole, as one GPU would;
a fleet shards them. Under `--tp N [--ep M] [--dp-attention]` this module computes, for vLLM and
SGLang, what each rank holds of every module the engine builds with the quantization config, and
checks it against the rules the engines enforce when they create the weights or pick a MoE kernel.
Each rule is cited to the function that enforces it (RULES); a layout that breaks one is refused
with the module, the rule and a layout of the same GPU count that passes (`working_layout`).

How each engine shards (the per-rank sizes below):
  - attention, each module as the family definition's `engine_attention` says the engine builds it
    (column-parallel outputs and row-parallel inputs split, a QKVParallelLinear's KV heads replicated
    when TP exceeds them, a ReplicatedLinear or a module built with TP disabled whole on every rank):
    over the attention TP size, which is 1 with `--dp-attention` (SGLang
    srt/layers/dp_attention.py supports attn_tp_size == 1 with dp == tp; vLLM runs DP attention as
    `--data-parallel-size N --tensor-parallel-size 1`).
  - the dense MLP and the shared expert: over TP (SGLang `DeepseekV2MLP(parallel_group="tp")`,
    models/deepseek_v2.py); vLLM under `--dp-attention` has TP 1, so whole.
  - routed experts: the intermediate dim over the MoE TP size, the experts over EP. SGLang:
    moe_tp_size = tp / ep_size (`FusedMoE.__init__`, srt/layers/moe/fused_moe_triton/layer.py).
    vLLM: `--enable-expert-parallel` puts the experts whole on EP = TP x DP ranks, otherwise
    they are TP-sharded over all TP x DP ranks (`FusedMoEParallelConfig.make`,
    model_executor/layers/fused_moe/config.py): no EP size between 1 and N.

The MoE kernel each engine picks for INT4 experts (shown in the report; GPU generation and group
size decide it):
  - vLLM (`select_wna16_moe_backend`, fused_moe/oracle/int_wna16.py, tried in order): FlashInfer
    TRT-LLM MxInt4 on Blackwell (sm100) for symmetric group-32 weights (`TrtLlmMxint4Experts`:
    no zero points); else Marlin where `check_moe_marlin_supports_config`
    (quantization/utils/marlin_utils.py) holds (hidden % 128, group in -1/32/64/128, whole groups
    per rank); else Triton.
  - SGLang (`CompressedTensorsConfig.get_moe_scheme`, compressed_tensors/compressed_tensors.py):
    on sm100 with the auto backend the Triton WNA16 MoE for symmetric INT4 group 32 or 128 without
    actorder (`_is_wna16_triton_moe_supported`); else Marlin (`CompressedTensorsWNA16MoE`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from quantkit.errors import ConfigError
from quantkit.serving.stored import Stored, expert_dims, inventory

# compute capability (x10) of the GPUs quantkit plan knows that vLLM and SGLang pick CUDA kernels for
GPU_SM = {"h100": 90, "h200": 90, "b200": 100, "h100-nvl": 90, "h20": 90, "a100-80": 80, "b300": 100}
FP8_BLOCK = 128

# rule id -> (what must hold, where each engine enforces it)
RULES: dict[str, tuple[str, dict[str, str]]] = {
    "even-split": (
        "a tensor-parallel dimension divides by its TP size",
        {"vllm": "model_executor/layers/linear.py ColumnParallelLinear/RowParallelLinear.__init__ (divide -> "
                 "ensure_divisibility asserts); fused_moe/layer.py FusedMoE.__init__",
         "sglang": "srt/layers/linear.py ColumnParallelLinear/RowParallelLinear.__init__ (divide); "
                   "srt/layers/moe/fused_moe_triton/layer.py FusedMoE.__init__ "
                   "(assert intermediate_size % moe_tp_size == 0)"}),
    "heads": (
        "the attention heads divide by the attention TP size (KV heads: TP a multiple of them when it exceeds them)",
        {"vllm": "models/deepseek_v2.py DeepseekV2MLAAttention.__init__ (num_local_heads = num_heads // tp_size); "
                 "model_executor/layers/linear.py QKVParallelLinear.__init__",
         "sglang": "srt/models/deepseek_v2.py DeepseekV2AttentionMLA.__init__; srt/layers/linear.py "
                   "QKVParallelLinear.__init__"}),
    "fp8-linear-block": (
        "an FP8 block Linear keeps its 128x128 blocks whole on each rank: a row-parallel input and each "
        "column-parallel / merged output per rank are multiples of 128",
        {"vllm": "model_executor/layers/quantization/utils/fp8_utils.py validate_fp8_block_shape "
                 "(from Fp8LinearMethod / CompressedTensorsW8A8Fp8 create_weights)",
         "sglang": "srt/layers/quantization/fp8.py Fp8LinearMethod.validate_block_quant_shapes (fp8 checkpoints: "
                   "every merged output whole); srt/layers/quantization/fp8_utils.py validate_fp8_block_shape "
                   "(compressed-tensors, from CompressedTensorsW8A8Fp8.create_weights)"}),
    "fp8-moe-block": (
        "FP8 block experts keep their 128x128 blocks whole: the per-rank intermediate size is a multiple of 128",
        {"vllm": "model_executor/layers/quantization/utils/fp8_utils.py validate_fp8_block_shape_moe "
                 "(from Fp8MoEMethod / CompressedTensorsW8A8Fp8MoEMethod create_weights)",
         "sglang": "srt/layers/quantization/fp8.py Fp8MoEMethod.create_weights; compressed_tensors/schemes/"
                   "compressed_tensors_w8a8_fp8_moe.py CompressedTensorsW8A8Fp8MoE.create_weights"}),
    "int4-group-per-rank": (
        "INT4 experts keep whole scale groups on each rank: the per-rank intermediate size (the down "
        "projection's K) is a multiple of the group size, so the scales split along K with the weights",
        {"vllm": "quantization/compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_wna16.py "
                 "CompressedTensorsWNA16MoEMethod.create_weights (ValueError)",
         "sglang": "srt/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16_moe.py "
                   "CompressedTensorsWNA16MoE.create_weights (num_groups_w2 = w2_scales_size // group_size "
                   "floors, so a group straddles two ranks and process_weights_after_loading's Marlin repack "
                   "gets a K that disagrees with the weight)"}),
    "int4-hidden-group": (
        "INT4 experts: the hidden size (gate/up's K) is a multiple of the group size",
        {"vllm": "compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights (ValueError)",
         "sglang": "compressed_tensors_wNa16_moe.py CompressedTensorsWNA16MoE.create_weights "
                   "(num_groups_w13 = hidden_size // group_size floors)"}),
    "int4-zero-point-pack": (
        "asymmetric INT4 experts: 2 x the per-rank intermediate size is a multiple of 8 (packed zero points "
        "whole per rank)",
        {"vllm": "compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod.create_weights (ValueError)"}),
    "ep-experts": (
        "the routed experts divide by the EP size (each rank holds the same number, none dropped)",
        {"sglang": "srt/layers/moe/fused_moe_triton/layer.py FusedMoE.__init__ "
                   "(_num_local_routed = _num_global_routed // storage_ep_size floors)"}),
    "ep-span": (
        "expert parallelism spans every TP x DP rank (--enable-expert-parallel): EP is 1 or the GPU count",
        {"vllm": "model_executor/layers/fused_moe/config.py FusedMoEParallelConfig.make"}),
}


@dataclass(frozen=True)
class Layout:
    """One serving instance's parallel layout: GPUs = tp; experts over ep (moe tp = tp / ep)."""

    tp: int = 1
    ep: int = 1
    dp_attention: bool = False
    gpu: str = "h200"

    def __post_init__(self):
        if self.gpu not in GPU_SM:
            raise ConfigError(f"--gpu {self.gpu}: choose from {', '.join(GPU_SM)}")
        if self.tp < 1 or self.ep < 1 or self.tp % self.ep:
            raise ConfigError(f"--tp {self.tp} --ep {self.ep}: the EP size must divide the TP size (GPUs per instance)")

    @property
    def sm(self) -> int:
        return GPU_SM[self.gpu]

    def flags(self) -> str:
        """quantkit check-serving's options for this layout."""
        out = f"--tp {self.tp}" + (f" --ep {self.ep}" if self.ep > 1 else "")
        return out + (" --dp-attention" if self.dp_attention else "") + f" --gpu {self.gpu}"

    def sizes(self, engine: str) -> dict[str, int]:
        """The TP size each part of the model is sharded over, and the EP size, for `engine`."""
        if engine == "vllm":
            tp = 1 if self.dp_attention else self.tp  # DP attention: --data-parallel-size N, TP 1
            return {"attn": tp, "dense": tp, "moe": 1 if self.ep > 1 else self.tp, "ep": self.tp if self.ep > 1 else 1}
        return {"attn": 1 if self.dp_attention else self.tp, "dense": self.tp, "moe": self.tp // self.ep, "ep": self.ep}


@dataclass
class LayoutProblem:
    module: str
    rule: str
    detail: str  # the per-rank numbers
    cite: str

    def text(self, engine: str) -> str:
        return f"{self.module}: {self.detail} (rule {self.rule}: {RULES[self.rule][0]}; {engine}: {self.cite})"


@dataclass
class LayoutReport:
    engine: str
    layout: Layout
    kernels: dict[str, str] = field(default_factory=dict)  # what each MoE runs on: "int4 experts" -> "Marlin"
    per_rank: dict[str, dict] = field(default_factory=dict)  # a few representative modules' rank shards
    problems: list[LayoutProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"engine": self.engine, "layout": asdict(self.layout), "ok": self.ok, "kernels": self.kernels,
                "per_rank": self.per_rank, "problems": [asdict(p) | {"text": p.text(self.engine)} for p in self.problems]}


# ---- the quantization config's INT4 scheme ----------------------------------------------------
def int4_scheme(qc: dict) -> dict | None:
    """The 4-bit group scheme's weights args (group_size, symmetric, actorder), or None."""
    for g in (qc.get("config_groups") or {}).values():
        w = g.get("weights") or {}
        if w.get("num_bits") == 4 and w.get("type", "int") == "int":
            return w
    return None


def moe_kernel(engine: str, layout: Layout, w: dict, hidden: int, inter_rank: int) -> str:
    """The INT4 MoE kernel `engine` picks on the layout's GPU (see the module docstring)."""
    g = w.get("group_size") or -1
    sym = bool(w.get("symmetric", True))
    if engine == "vllm":
        if layout.sm >= 100 and sym and g == 32:
            return "FlashInfer TRT-LLM MxInt4 (symmetric only)"
        if hidden % 128 == 0 and g in (-1, 32, 64, 128) and (g <= 0 or inter_rank % g == 0):
            return "Marlin"
        return "Triton WNA16"
    if layout.sm >= 100 and sym and g in (32, 128) and not w.get("actorder"):
        return "Triton WNA16 (symmetric, group 32/128)"
    return "Marlin"


# ---- per-rank checks ----------------------------------------------------------------------------
def _part(m_name: str) -> str:
    if ".self_attn." in m_name:
        return "attn"
    return "moe" if m_name.endswith("mlp.experts") else "dense"


def check_layout(st, layout: Layout, engine: str, mods: list | None = None) -> LayoutReport:
    """Every module `engine` builds with the quantization config of the stored checkpoint `st`
    (quantkit.serving.stored), at `layout`: the rank shards against RULES. One problem per module
    and rule: the first layer that breaks it, with how many layers do.
    `mods`: `inventory(st, engine)` when the caller has it (it is the slow part)."""
    from quantkit.model.arch import arch_from_config
    rep = LayoutReport(engine, layout)
    sizes = layout.sizes(engine)
    if engine == "vllm" and 1 < layout.ep < layout.tp:
        rep.problems.append(_problem(engine, "all routed experts", "ep-span",
                                     f"--ep {layout.ep} of {layout.tp} GPUs; vLLM's EP is 1 or {layout.tp}"))
    shape = _shapes(st)
    arch = arch_from_config(st.config, source="config.json")
    sizes["experts"] = arch.n_routed_experts  # in DeepSeek-V3's field names, whatever the family calls it
    heads = (arch.num_attention_heads, arch.definition.attention.kv_heads(arch) or arch.num_attention_heads)
    found: list[LayoutProblem] = []
    for m in inventory(st, engine) if mods is None else mods:
        if m.kind == "lm_head":
            continue
        if m.kind == "moe":
            found += _check_moe(st, m, layout, engine, sizes, rep)
        else:
            found += _check_linear(st, m, sizes[_part(m.name)], engine, shape, rep, heads)
    rep.problems += _first_per_module(found) + _check_heads(heads, sizes["attn"], engine)
    return rep


def _first_per_module(found: list[LayoutProblem]) -> list[LayoutProblem]:
    """One problem per (module in any layer, rule, numbers): the first, with the layer count."""
    seen: dict[tuple, list] = {}
    for p in found:
        key = (re.sub(r"layers\.\d+\.", "layers.N.", p.module), p.rule, p.detail)
        seen.setdefault(key, []).append(p)
    out = []
    for group in seen.values():
        p = group[0]
        if len(group) > 1:
            p = LayoutProblem(p.module, p.rule, f"{p.detail}; {len(group)} layers alike", p.cite)
        out.append(p)
    return out


def _shapes(st):
    """A stored module's [out, in] (INT4: unpacked from weight_packed)."""
    def shape(mod: str) -> tuple[int, int] | None:
        if f"{mod}.weight" in st.tensors:
            return tuple(st.tensors[f"{mod}.weight"][1])
        if f"{mod}.weight_packed" in st.tensors:
            out, packed = st.tensors[f"{mod}.weight_packed"][1]
            return out, packed * 8
        return None
    return shape


def _problem(engine: str, module: str, rule: str, detail: str) -> LayoutProblem:
    return LayoutProblem(module, rule, detail, RULES[rule][1].get(engine, ""))


PARALLEL = {"ColumnParallelLinear": "column", "MergedColumnParallelLinear": "column", "QKVParallelLinear": "qkv",
            "RowParallelLinear": "row"}


def _check_linear(st, m, tp: int, engine: str, shape, rep: LayoutReport,
                  heads: tuple[int, int]) -> list[LayoutProblem]:
    """`heads`: (attention heads, KV heads) for a QKVParallelLinear's per-rank rows."""
    style = m.tp_split or PARALLEL.get(m.klass, "replicated")  # the definition's, else the class's
    shapes = [shape(s) for s in m.shards]
    if any(s is None for s in shapes):
        return []
    outs, k = [s[0] for s in shapes], shapes[0][1]
    if m.single:
        outs = [sum(outs)]  # one Linear over the concatenated output, not a merged one
    split = tp if style != "replicated" else 1
    if style == "qkv":
        outs_rank = _qkv_rank(outs, tp, heads)
    elif style == "column":
        outs_rank = [o // split for o in outs]
    else:
        outs_rank = list(outs)
    k_rank = k // split if style == "row" else k
    rep.per_rank.setdefault(m.name.rsplit(".", 1)[-1], {"out": outs_rank, "in": k_rank, "tp": split, "stored": m.stored})
    out: list[LayoutProblem] = []
    uneven = [o for o in outs if o % split] if style == "column" else ([k] if style == "row" and k % split else [])
    if uneven:
        return [_problem(engine, m.name, "even-split", f"{uneven[0]} does not divide by TP {split}")]
    if m.stored != "fp8":
        return out
    if style == "row" and split > 1 and k_rank % FP8_BLOCK:
        out.append(_problem(engine, m.name, "fp8-linear-block",
                            f"FP8 input per rank {k} / {split} = {k_rank}, not a multiple of {FP8_BLOCK}"))
    merged = len(outs_rank) > 1
    if (style in ("column", "qkv") and split > 1) or merged:
        # validate_fp8_block_shape lets a merged module's last output end in a partial block when it is
        # not TP-split; SGLang's Fp8LinearMethod (fp8 checkpoints) does not
        strict = split > 1 or (engine == "sglang" and st.qc.get("quant_method") == "fp8")
        check = outs_rank if strict else outs_rank[:-1]
        bad = [o for o in check if o % FP8_BLOCK]
        if bad:
            out.append(_problem(engine, m.name, "fp8-linear-block",
                                f"FP8 output per rank {bad[0]} (of {outs}, TP {split}) not a multiple of {FP8_BLOCK}"))
    return out


def _qkv_rank(outs: list[int], tp: int, heads: tuple[int, int]) -> list[int]:
    """QKVParallelLinear's per-rank q, k, v rows: KV heads replicate when TP exceeds them."""
    hd = outs[0] // heads[0]
    kv_rank = max(1, heads[1] // tp)
    return [outs[0] // tp, kv_rank * hd, kv_rank * hd]


def _check_heads(heads_kv: tuple[int, int], attn_tp: int, engine: str) -> list[LayoutProblem]:
    """The attention heads, and the KV heads the attention kind splits over TP (`Attention.kv_heads`;
    one shared latent counts as the attention heads), against the attention TP size."""
    heads, kv = heads_kv
    if heads % attn_tp:
        return [_problem(engine, "self_attn (every layer)", "heads", f"{heads} heads over attention TP {attn_tp}")]
    if kv < attn_tp and attn_tp % kv or kv >= attn_tp and kv % attn_tp:
        return [_problem(engine, "self_attn (every layer)", "heads", f"{kv} KV heads over attention TP {attn_tp}")]
    return []


def _check_moe(st, m, layout: Layout, engine: str, sizes: dict, rep: LayoutReport) -> list[LayoutProblem]:
    experts = sorted({s.rsplit(".", 1)[0] for s in m.shards})
    n, (inter, hidden) = sizes["experts"], expert_dims(st, experts[0])
    moe_tp, ep = sizes["moe"], sizes["ep"]
    out: list[LayoutProblem] = []
    if ep > 1 and n % ep and engine == "sglang":
        out.append(_problem(engine, m.name, "ep-experts", f"{n} routed experts over EP {ep}"))
    if inter % moe_tp:
        return out + [_problem(engine, m.name, "even-split", f"intermediate {inter} over MoE TP {moe_tp}")]
    inter_rank = inter // moe_tp
    rep.per_rank.setdefault("routed experts", {"intermediate": inter_rank, "hidden": hidden, "experts": n // ep,
                                               "moe_tp": moe_tp, "ep": ep, "stored": m.stored})
    if m.stored == "fp8":
        rep.kernels.setdefault("fp8 experts", "block FP8 MoE")
        if inter_rank % FP8_BLOCK:
            out.append(_problem(engine, m.name, "fp8-moe-block",
                                f"FP8 expert intermediate per rank {inter} / {moe_tp} = {inter_rank}, "
                                f"not a multiple of {FP8_BLOCK}"))
    elif m.stored == "int4":
        w = int4_scheme(st.qc) or {}
        g = int(w.get("group_size") or -1)
        rep.kernels.setdefault("int4 experts", moe_kernel(engine, layout, w, hidden, inter_rank) + f", group {g}")
        if g > 0 and inter_rank % g:
            out.append(_problem(engine, m.name, "int4-group-per-rank",
                                f"INT4 group {g} over an intermediate per rank of {inter} / {moe_tp} = {inter_rank}"))
        if g > 0 and hidden % g:
            out.append(_problem(engine, m.name, "int4-hidden-group", f"INT4 group {g} over hidden {hidden}"))
        if not w.get("symmetric", True) and engine == "vllm" and (2 * inter_rank) % 8:
            out.append(_problem(engine, m.name, "int4-zero-point-pack", f"2 x {inter_rank} zero points per rank"))
    return out


# ---- a layout that works -------------------------------------------------------------------------
def candidates(layout: Layout) -> list[Layout]:
    """Layouts to try instead, nearest first: the same GPUs with experts whole (EP = TP), then DP
    attention, then smaller EP, then fewer GPUs per instance (more replicas)."""
    out = []
    tp = layout.tp
    while tp >= 1:
        eps = [tp] + [e for e in range(tp - 1, 0, -1) if tp % e == 0]
        for ep in eps:
            for dpa in (layout.dp_attention, not layout.dp_attention):
                cand = Layout(tp, ep, dpa, layout.gpu)
                if cand != layout and cand not in out:
                    out.append(cand)
        tp //= 2
    return out


def working_layout(stored: list, layout: Layout, engines) -> Layout | None:
    """The first candidate layout every checkpoint passes on every engine; None if there is none."""
    mods = {(i, e): inventory(st, e) for i, st in enumerate(stored) for e in engines}
    for cand in candidates(layout):
        if all(check_layout(st, cand, e, mods[i, e]).ok for i, st in enumerate(stored) for e in engines):
            return cand
    return None


# ---- a checkpoint predicted from config.json (quantkit plan, presets) -------------------------
_BF16_CLASSES = {"router", "norm", "embedding", "head", "vision", "kv_scale"}


def predicted_stored(config: dict, phase: str, *, group_size: int, symmetric: bool = True,
                     bf16_projs: tuple[str, ...] | None = None, all_experts: bool = False):
    """The tensor names, dtypes and shapes `quantkit convert` writes for `phase` (prefill: FP8 block
    Linears; decode: INT4 routed experts, the rest as prefill) from a config alone: what check_layout
    reads, without the bytes (`quantkit plan` checks a preset's layout with it).

    `bf16_projs`: attention projections kept BF16; None: the family's `prefill_bf16_projections`,
    what the shipped recipe keeps (Kimi K2.6's q_a_proj and kv_a_proj_with_mqa).

    `all_experts`: list every routed expert; by default only expert 0 of each layer (every expert has
    the same shapes and format, the count comes from the config), which keeps a 384-expert model fast."""
    from quantkit.model.arch import arch_from_config
    from quantkit.model.inventory import tensor_inventory

    a = arch_from_config(config, source="config")
    if bf16_projs is None:
        bf16_projs = a.definition.prefill_bf16_projections
    keep = set(bf16_projs) | set(a.definition.always_bf16) | {"eh_proj"}
    tensors: dict[str, tuple[str, list[int]]] = {}
    for spec in tensor_inventory(a):
        names = [spec.name]
        if ".experts.0." in spec.name and all_experts:
            names = [spec.name.replace(".experts.0.", f".experts.{e}.") for e in range(spec.count)]
        proj = spec.name.rsplit(".", 2)[-2]
        if phase == "decode" and spec.klass.value == "routed_expert":
            fmt = "int4"
        elif (not spec.linear or spec.klass.value in _BF16_CLASSES or proj in keep
              or spec.shape[-1] % FP8_BLOCK):  # quantkit.formats.fp8.cannot_run: kept BF16
            fmt = "bf16"
        else:
            fmt = "fp8"
        for n in names:
            _add(tensors, n.removesuffix(".weight"), spec.shape, fmt, group_size)
    text = config.get("text_config", config)
    w = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size}
    qc = ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": w}}}
          if phase == "decode" else {"quant_method": "fp8", "weight_block_size": [FP8_BLOCK, FP8_BLOCK]})
    return Stored(config, text, qc, tensors)


def _add(tensors: dict, mod: str, shape: tuple, fmt: str, group: int) -> None:
    if len(shape) != 2:
        tensors[f"{mod}.weight"] = ("bfloat16", list(shape))
        return
    out, k = shape
    if fmt == "int4":
        tensors[f"{mod}.weight_packed"] = ("int32", [out, k // 8])
        tensors[f"{mod}.weight_scale"] = ("bfloat16", [out, k // group if group > 0 else 1])
        tensors[f"{mod}.weight_shape"] = ("int32", [2])
    elif fmt == "fp8":
        tensors[f"{mod}.weight"] = ("float8_e4m3fn", [out, k])
        tensors[f"{mod}.weight_scale_inv"] = ("float32", [-(-out // FP8_BLOCK), -(-k // FP8_BLOCK)])
    else:
        tensors[f"{mod}.weight"] = ("bfloat16", [out, k])

