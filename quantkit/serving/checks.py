"""Will vLLM and SGLang load this checkpoint? Asked of the engines' own code, module by module.

`check_serving(folder)` lists the modules each engine builds with the checkpoint's quantization
config (`inventory`), hands the config and that list to the pinned release's own resolution code
(`quantkit.serving.engines`, run in `quantkit.serving.harness`), and judges each answer against what the
checkpoint stores:

  - routed experts stored INT4 must get the engine's W4A16 MoE scheme;
  - FP8 modules must get block FP8 with the block the scales were written for (128);
  - BF16 modules must stay unquantized;
  - the tensors the scheme's `create_weights` registers must take the stored tensors (names,
    dtypes, shapes; fused modules and the experts' transposed layout accounted for);
  - an FP8 Linear's input dim must be whole 128-column activation groups (`block_shape_problems`:
    a runtime rule, not a load-time one), for each engine and for compressed-tensors' own forward
    (transformers), which names every tensor a target would refuse.

Any engine exception is a refusal, reported with the module and the engine's message.

What the engines build is a cited reading (the model files cannot run without a GPU), kept small:
  - names: the stored ones, except fused `q_a_proj`+`kv_a_proj_with_mqa` (SGLang
    `fused_qkv_a_proj_with_mqa` ReplicatedLinear, vLLM `fused_qkv_a_proj`, both deepseek_v2.py
    `DeepseekV2AttentionMLA.__init__`), fused `gate_proj`+`up_proj` (`gate_up_proj`,
    `DeepseekV2MLP`), routed experts as one `mlp.experts` FusedMoE; SGLang runs Kimi K2.5/K2.6's
    text model without the `language_model.` prefix (models/kimi_k25.py `KimiK25ForConditionalGeneration.__init__`)
    and the MTP layer as its draft model's `model.decoder.` (models/deepseek_nextn.py); vLLM keeps
    `model.layers.N.` for MTP (models/deepseek_mtp.py `DeepSeekMultiTokenPredictorLayer`).
  - not built with the quantization config: the DSA indexer's `weights_proj` (SGLang, BF16
    `params_dtype`) and vLLM's fused `wk_weights_proj` (`quant_config=None`, FP8 `wk` upcast on
    load), MTP `eh_proj` (plain `nn.Linear` in both), the router gate, Kimi's vision tower and
    projector under compressed-tensors (both engines pass `quant_config=None` to them).
  - SGLang's shared-expert fusion (`DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason`,
    models/deepseek_v2.py): for the allowed architectures (DeepseekV3ForCausalLM,
    GlmMoeDsaForCausalLM, their NextN drafts) with 256 routed experts and one shared expert it
    fuses the shared expert into the routed MoE unless `is_wint4afp8_or_wint4a16_config` (run for
    real) says the `Linear` group is INT4 (Kimi's 384 experts fuse only for Quark checkpoints).
    When routed and shared experts are stored differently, fusion would load the shared expert
    into the routed scheme: the report then asks for `--disable-shared-experts-fusion`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantkit.errors import ConfigError
from quantkit.model.families import family_of
from quantkit.serving.stored import Module, Stored, inventory, read_stored, stored_format

ENGINES = ("vllm", "sglang")
FP8_BLOCK = 128
FUSION_ARCHS = {"DeepseekV3ForCausalLM": 256, "GlmMoeDsaForCausalLM": 256}
# what each engine calls the W4A16 MoE scheme (SGLang: the Marlin, Triton and MxInt4 variants)
INT4_MOE = {"CompressedTensorsWNA16MoE", "CompressedTensorsWNA16TritonMoE", "CompressedTensorsMxInt4MoE",
            "CompressedTensorsWNA16MoEMethod"}
UNQUANTIZED = {"UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "None"}


@dataclass
class Row:
    module: str
    stored: str
    scheme: str  # the engine's method/scheme, e.g. "CompressedTensorsW8A8Fp8 block [128, 128]"
    ok: bool
    problem: str | None = None
    params_checked: bool = False  # the stored tensors were compared with what create_weights registered
    note: str | None = None  # why they were not (create_weights could not run on CPU)


@dataclass
class EngineReport:
    engine: str
    version: str | None
    source: str  # "engine code" (pinned release executed) or "rules" (offline re-statement)
    loads: bool
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)  # launch flags this checkpoint needs
    stubbed: int = 0
    layout: dict | None = None  # the per-rank check at the user's layout (quantkit.serving.layout)


@dataclass
class ServingReport:
    folder: str
    quant_method: str
    engines: list[EngineReport]
    # compressed-tensors' own forward (what transformers runs for a compressed-tensors checkpoint):
    # the tensors it cannot compute (`block_shape_problems`)
    compressed_tensors: list[str] = field(default_factory=list)

    @property
    def loads(self) -> bool:
        return all(e.loads for e in self.engines) and not self.compressed_tensors

    def to_dict(self) -> dict:
        return {"folder": self.folder, "quant_method": self.quant_method, "loads": self.loads,
                "engines": [asdict(e) for e in self.engines], "compressed_tensors": self.compressed_tensors}

# ---- judging the engine's answer ---------------------------------------------------------------
def _scheme_label(ans: dict) -> str:
    name = ans.get("scheme") or ans.get("method") or "None"
    if ans.get("block"):
        name += f" block {ans['block']}"
    return name


def _judge(m: Module, ans: dict, st: Stored) -> str | None:
    """Why the engine's answer for module `m` would not load or not compute what is stored; None if fine."""
    if ans.get("error"):
        return f"refused: {ans['error']}"
    got = ans.get("scheme") or ans.get("method") or "None"
    if m.stored == "mixed":
        return "its shards are stored in different formats; engines load a fused module in one scheme"
    if m.stored == "int4":
        if got not in INT4_MOE:
            return f"stored INT4 (pack-quantized) but the engine picks {got}"
    elif m.stored == "fp8":
        if "Fp8" not in got:
            return f"stored FP8 blocks but the engine picks {got}"
        if ans.get("block") != [FP8_BLOCK, FP8_BLOCK]:
            return f"stored FP8 {FP8_BLOCK}x{FP8_BLOCK} blocks but the engine's block size is {ans.get('block')}"
    elif got not in UNQUANTIZED:
        return f"stored BF16 but the engine picks {got}: {ignore_fix(st, m)}"
    if ans.get("params"):
        return _check_params(m, ans["params"], st)
    return None


def _check_params(m: Module, params: dict, st: Stored) -> str | None:
    """The stored tensors against what create_weights registered (TP 1)."""
    if m.kind == "moe":
        return _check_expert_params(m, params, st)
    return _check_linear_params(m, params, st)


# a routed expert's stored tensors, and the fused parameter each one loads into
_EXPERT_SUFFIXES = ("weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_shape", "weight_zero_point")
_FUSED_PREFIX = {"gate_proj": "w13_", "up_proj": "w13_", "down_proj": "w2_"}


def _check_expert_params(m: Module, params: dict, st: Stored) -> str | None:
    """Every expert's tensors against the per-expert slice of the fused parameters."""
    for shard in m.shards:
        prefix = _FUSED_PREFIX[shard.rsplit(".", 1)[1]]
        for suffix in _EXPERT_SUFFIXES:
            name = f"{shard}.{suffix}"
            if name not in st.tensors:
                continue
            why = _check_expert_tensor(name, st.tensors[name], prefix, suffix, params.get(prefix + suffix))
            if why:
                return why
    return None


def _check_expert_tensor(name: str, stored: tuple[str, list[int]], prefix: str, suffix: str, p: dict | None) -> str | None:
    """One expert's stored tensor against the fused parameter `p` (prefix + suffix): its shape per
    expert (transposed where the engine stores it so; gate and up stacked in w13), and its dtype
    (weight_shape: its shape only)."""
    if p is None:
        return f"{name}: the engine registers no {prefix + suffix} for it"
    dtype, shape = stored
    per_expert = list(p["shape"][1:])
    want = list(shape)
    if suffix != "weight_shape":
        if p.get("transposed"):
            want = want[::-1]
        if prefix == "w13_":
            want[1 if p.get("transposed") else 0] *= 2
    if per_expert != want:
        return f"{name} {shape}: {prefix + suffix} holds {per_expert} per expert"
    if suffix != "weight_shape" and dtype != p["dtype"]:
        return f"{name}: stored {dtype}, {prefix + suffix} is {p['dtype']}"
    return None


def _check_linear_params(m: Module, params: dict, st: Stored) -> str | None:
    """A Linear's shards (fused: each one) against its parameters: dtypes and shapes past the first
    dimension, then the rows they add up to."""
    rows_w = rows_s = 0
    for shard in m.shards:
        for suffix in ("weight", "weight_scale", "weight_scale_inv"):
            name = f"{shard}.{suffix}"
            if name not in st.tensors:
                continue
            p = params.get(suffix)
            if p is None:
                return f"{name}: the engine registers no {suffix} on {m.name}"
            dtype, shape = st.tensors[name]
            if dtype != p["dtype"]:
                return f"{name}: stored {dtype}, {m.name}.{suffix} is {p['dtype']}"
            if shape[1:] != p["shape"][1:]:
                return f"{name} {shape}: {m.name}.{suffix} is {p['shape']}"
            if suffix == "weight":
                rows_w += shape[0]
            else:
                rows_s += shape[0]
    return _check_linear_rows(m, params, rows_w, rows_s)


def _check_linear_rows(m: Module, params: dict, rows_w: int, rows_s: int) -> str | None:
    """The shards' rows (weights, scales) against the engine's parameters' first dimension."""
    if "weight" in params and rows_w != params["weight"]["shape"][0]:
        return f"{m.name}: shards hold {rows_w} rows, the engine's weight {params['weight']['shape'][0]}"
    for s in ("weight_scale", "weight_scale_inv"):
        if s in params and rows_s and rows_s != params[s]["shape"][0]:
            return f"{m.name}: shards hold {rows_s} scale rows, the engine's {s} {params[s]['shape'][0]}"
    return None


# Where each target runs a block-FP8 Linear's activations through per-token-group quantization, which
# needs the input dim to be whole groups of the block (the weight's output dim may end in a partial
# block: every scale grid uses ceil). Not a load-time check at TP 1 (`create_weights` accepts it): the
# first forward fails. The TP-split and merged-GEMM output rules are load-time ones, run for real by
# the engines' own `create_weights` (vLLM `validate_fp8_block_shape`, SGLang `Fp8LinearMethod.
# validate_block_quant_shapes`, both in the harness).
ACTIVATION_GROUP_RULE = {
    "vllm": "vLLM's per_token_group_quant_fp8 asserts x.shape[-1] % group_size == 0 at the first forward "
            "(model_executor/layers/quantization/utils/fp8_utils.py)",
    "sglang": "SGLang's sglang_per_token_group_quant_fp8 asserts x.shape[-1] % group_size == 0 at the first forward "
              "(srt/layers/quantization/fp8_kernel.py)",
    "compressed-tensors": "compressed-tensors' forward quantizes the input in groups of 128 and fails (\"unflatten: "
                          "Provided sizes [1, 128] don't multiply up\"; quantization/lifecycle/forward.py), so "
                          "transformers cannot run it",
}


def block_shape_problems(target: str, st: Stored, mods: list[Module]) -> list[str]:
    """The stored FP8 weights `target` (an engine, or "compressed-tensors") cannot compute: each named
    with its shape, the rule and the fix (quantkit convert stores such a Linear BF16:
    quantkit.formats.fp8.cannot_run)."""
    out = []
    for m in mods:
        if m.kind != "linear":
            continue
        for shard in m.shards:
            name = f"{shard}.weight"
            if stored_format(st, shard) != "fp8" or name not in st.tensors:
                continue
            shape = st.tensors[name][1]
            if len(shape) == 2 and shape[1] % FP8_BLOCK:
                out.append(f"{name} {shape}: FP8 blocks over an input dim of {shape[1]}, not a multiple of "
                           f"{FP8_BLOCK}: {ACTIVATION_GROUP_RULE[target]}; store it BF16 (quantkit convert does)")
    return out


def sglang_fusion_flags(config: dict, routed: str, shared: str, linear_int4: bool | None = None) -> list[str]:
    """`["--disable-shared-experts-fusion"]` when SGLang would fuse this checkpoint's shared expert into
    the routed MoE while the two are stored differently (the gate is cited in the module docstring).

    `linear_int4`: what SGLang's `is_wint4afp8_or_wint4a16_config` answers (check-serving runs it);
    None re-states it from the config (the group targeting `Linear` is INT4 weight-only).
    """
    text = config.get("text_config", config)
    arch = (config.get("architectures") or [""])[0]
    if FUSION_ARCHS.get(arch) != text.get("n_routed_experts") or text.get("n_shared_experts") != 1:
        return []
    if linear_int4 is None:
        qc = config.get("quantization_config") or text.get("quantization_config") or {}
        linear_int4 = _linear_group_is_int4(qc)
    if linear_int4 or not routed or not shared or routed == shared:
        return []  # SGLang turns fusion off itself, or there is nothing to mis-load
    return ["--disable-shared-experts-fusion"]


def fusion_flag(engine: str, st: Stored, mods: list[Module], wint4_linear: bool | None) -> list[str]:
    """`sglang_fusion_flags` for a stored checkpoint: the routed and shared experts' formats read from
    `mods` (its `inventory`); serve-commands asks it for the decode pool's flags."""
    if engine != "sglang":
        return []
    routed = {m.stored for m in mods if m.kind == "moe"}
    shared = {m.stored for m in mods if ".shared_experts." in m.name}
    return sglang_fusion_flags(st.config, ",".join(sorted(routed)), ",".join(sorted(shared)), bool(wint4_linear))


# the model classes' packed_modules_mapping beside the attention's (deepseek_v2.py DeepseekV2ForCausalLM.__init__)
MLP_PACKED = {"sglang": {}, "vllm": {"gate_up_proj": ["gate_proj", "up_proj"]}}


def packed_modules(engine: str, st: Stored) -> dict[str, list[str]]:
    """The engine model class's packed_modules_mapping: the MLP's, and the attention's from the definition."""
    return MLP_PACKED[engine] | family_of(st.config.get("model_type")).packed(engine)


def engine_reports(engine: str, stored: list[Stored], *, download: bool) -> list[EngineReport]:
    """One engine's verdict on each checkpoint (one child process for all of them)."""
    from quantkit.serving.engines import EngineUnavailable, engine_source, run_harness

    inventories = [inventory(st, engine) for st in stored]
    try:
        src = engine_source(engine, download=download)
    except EngineUnavailable as e:
        return [rules_report(engine, st, mods, reason=str(e)) for st, mods in zip(stored, inventories)]
    jobs = [{"quantization_config": st.qc, "packed_modules_mapping": packed_modules(engine, st), "create_weights": True,
             "modules": [{"name": m.name, "class": m.klass, "kind": m.kind, "create": m.create} for m in mods]}
            for st, mods in zip(stored, inventories)]
    ans = run_harness(src, {"jobs": jobs})
    return [_verdict(engine, src.version, st, mods, job, len(ans.get("stubbed", [])))
            for st, mods, job in zip(stored, inventories, ans["jobs"])]


def _verdict(engine: str, version: str, st: Stored, mods: list[Module], ans: dict, stubbed: int) -> EngineReport:
    rep = EngineReport(engine, version, "engine code", True, stubbed=stubbed)
    if "fatal" in ans:
        rep.loads = False
        rep.problems.append(f"the quantization config is refused: {ans['fatal']}")
        return rep
    for m, a in zip(mods, ans["modules"]):
        problem = _judge(m, a, st)
        rep.rows.append(Row(m.name, m.stored, _scheme_label(a), problem is None, problem,
                            params_checked=bool(a.get("params")), note=a.get("params_error")))
        if problem:
            rep.problems.append(f"{m.name}: {problem}")
    rep.problems += block_shape_problems(engine, st, mods)
    if engine == "sglang" and any(m.stored == "fp8" for m in mods):
        wbs = ans.get("weight_block_size")
        if wbs != [FP8_BLOCK, FP8_BLOCK]:
            rep.problems.append(f"weight_block_size is {wbs} (SGLang reads it from the group targeting Linear); "
                                f"kv_b_proj's {FP8_BLOCK}x{FP8_BLOCK} block scales would be misread")
    rep.flags = fusion_flag(engine, st, mods, ans.get("wint4_linear_config"))
    rep.loads = not rep.problems
    return rep


def rules_report(engine: str, st: Stored, mods: list[Module], *, reason: str) -> EngineReport:
    """Offline fallback: the engines' rules as re-stated in RULES, applied without their code."""
    from quantkit.serving.engines import PINNED

    rep = EngineReport(engine, PINNED[engine], "rules", True)
    rep.problems += rules_check(engine, st, mods) + block_shape_problems(engine, st, mods)
    rep.flags = fusion_flag(engine, st, mods, _linear_group_is_int4(st.qc))
    rep.loads = not rep.problems
    rep.rows = [Row(m.name, m.stored, "(rules)", True) for m in mods]
    rep.flags.append(f"# engine code unavailable ({reason}); checked against quantkit.serving.checks.RULES")
    return rep


def ignore_fix(st: Stored, m: Module) -> str:
    """What to add to the quantization config so the engines leave a BF16 module alone."""
    key = "modules_to_not_convert" if st.qc.get("quant_method") == "fp8" else "ignore"
    n_layers = int(st.text["num_hidden_layers"])
    layer = re.search(r"layers\.(\d+)\.", m.shards[0])
    if layer and int(layer.group(1)) >= n_layers:  # the MTP layer: its own name and SGLang's draft name
        pats = [rf"re:(^|.*\.)layers\.{layer.group(1)}\..*", r"re:(^|.*\.)decoder\..*"]
        return (f"the MTP layer (num_nextn_predict_layers) is stored BF16 but quantization_config.{key} does not "
                f"list it; add '{pats[0]}' and '{pats[1]}' (SGLang's draft-model names)")
    pats = [rf"re:(^|.*\.){re.escape(s.split('.', 1)[1] if s.startswith('model.') else s)}$" for s in m.shards]
    quoted = ", ".join(f"'{p}'" for p in pats)
    return f"quantization_config.{key} does not list it; add {quoted}"


RULES = """\
Re-statement of the pinned engines' rules (used only when their code cannot be fetched):
1. SGLang W4A16 MoE schemes need the top-level `format` == "pack-quantized" (compressed_tensors_wNa16_moe.py).
2. SGLang matches a module by name, then by class name (`Linear`), then by fused shards
   (compressed_tensors/utils.py find_matched_target): the group targeting `Linear` must be the one
   fused gate_up_proj / fused_qkv_a_proj_with_mqa should get.
3. SGLang reads weight_block_size only from the group targeting `Linear`.
4. vLLM uses each group's own `format` and matches name, fused shards, then class name.
5. Both: a module a config group targets is quantized unless `ignore` (compressed-tensors) or
   `modules_to_not_convert` (fp8) lists it (vLLM compressed_tensors/utils.py should_ignore_layer,
   SGLang compressed_tensors/utils.py should_ignore_layer, vLLM/SGLang Fp8Config is_layer_skipped):
   a module stored BF16 must be listed, the MTP layer's included.
"""


def _linear_group_is_int4(qc: dict) -> bool:
    for g in (qc.get("config_groups") or {}).values():
        if "Linear" in g.get("targets", []):
            w = g.get("weights") or {}
            return w.get("num_bits") == 4 and w.get("type") == "int" and not g.get("input_activations")
    return False


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name or name.endswith("." + pattern) or pattern in name.split(".")


def bf16_not_ignored(st: Stored, mods: list[Module]) -> list[str]:
    """Rule 5: the modules stored BF16 that a group targets and the ignore list misses (under their
    runtime name and every stored shard's name)."""
    qc = st.qc
    if qc.get("quant_method") == "fp8":
        ignore, targets = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [], ["Linear", "FusedMoE"]
    else:
        ignore = qc.get("ignore") or []
        targets = [t for g in (qc.get("config_groups") or {}).values() for t in g.get("targets", [])]
    out = []
    for m in mods:
        if m.stored != "bf16" or m.kind == "lm_head":
            continue
        names = [m.name, *m.shards]
        cls = "FusedMoE" if m.kind == "moe" else "Linear"
        if not any(t == cls or any(_matches(t, n) for n in names) for t in targets):
            continue  # no group targets it: unquantized anyway
        if any(_matches(p, n) for p in ignore for n in names):
            continue
        out.append(f"{m.name}: stored BF16 but a config group targets it: {ignore_fix(st, m)} (rule 5)")
    return out


def rules_check(engine: str, st: Stored, mods: list[Module]) -> list[str]:
    """The problems RULES predicts for this checkpoint (rules 1-3 SGLang only: vLLM's accept both layouts)."""
    qc = st.qc
    if qc.get("quant_method") not in ("compressed-tensors", "fp8"):
        return []
    out = bf16_not_ignored(st, mods)
    if qc.get("quant_method") != "compressed-tensors" or engine != "sglang":
        return out
    if any(m.stored == "int4" for m in mods) and qc.get("format") != "pack-quantized":
        out.append(f"top-level format {qc.get('format')!r}: SGLang's W4A16 MoE schemes need 'pack-quantized' (rule 1)")
    linear = next((g for g in qc.get("config_groups", {}).values() if "Linear" in g.get("targets", [])), None)
    fp8 = any(m.stored == "fp8" for m in mods)
    if linear is not None and fp8 and (linear.get("weights") or {}).get("type") != "float":
        out.append("the group targeting Linear is not the FP8 group: fused modules and weight_block_size "
                       "follow it in SGLang (rules 2, 3)")
    return out


def check_serving(folder: str | Path, engines: tuple[str, ...] = ENGINES, *, download: bool = True) -> ServingReport:
    """Resolve every module of one checkpoint folder with each engine's pinned code (see module docstring)."""
    return check_serving_many([folder], engines, download=download)[0]


def check_serving_many(folders: list[str | Path], engines: tuple[str, ...] = ENGINES, *,
                       download: bool = True, layout=None) -> list[ServingReport]:
    """`check_serving` for several folders, one engine process each (a convert output's pair).
    `layout` (a quantkit.serving.layout.Layout): also check every module's shard per rank under it."""
    for e in engines:
        if e not in ENGINES:
            raise ConfigError(f"unknown engine {e!r}; choose from {', '.join(ENGINES)} or all")
    paths = [Path(f) for f in folders]
    stored = [read_stored(p) for p in paths]
    per_engine = {e: engine_reports(e, stored, download=download) for e in engines}
    if layout is not None:
        add_layout_checks(stored, per_engine, layout)
    return [ServingReport(str(p), st.qc.get("quant_method", "?"), [per_engine[e][i] for e in engines],
                          compressed_tensors_problems(st))
            for i, (p, st) in enumerate(zip(paths, stored))]


def add_layout_checks(stored: list[Stored], per_engine: dict[str, list[EngineReport]], layout) -> None:
    """Each folder's modules at `layout`, per engine (quantkit.serving.layout): a broken rule is a
    refusal naming the module, the rule, its citation and a layout of the same GPUs that passes."""
    from quantkit.serving.layout import check_layout, working_layout

    reports = {(e, i): check_layout(st, layout, e) for e in per_engine for i, st in enumerate(stored)}
    works = None
    if not all(r.ok for r in reports.values()):
        found = working_layout(stored, layout, tuple(per_engine))
        works = (f"a layout that works: {found.flags()}" if found else
                 "no layout of these GPUs passes every engine: convert with a smaller --group-size")
    for (e, i), r in reports.items():
        rep = per_engine[e][i]
        rep.layout = r.to_dict() | ({"works": works} if works else {})
        if r.problems:  # the way out first: the CLI prints the first few problems
            rep.problems.append(f"at {layout.flags()}: {len(r.problems)} module(s) break a kernel rule; {works}")
        rep.problems += [f"at {layout.flags()}: {p.text(e)}" for p in r.problems]
        rep.loads = rep.loads and r.ok


def compressed_tensors_problems(st: Stored) -> list[str]:
    """What compressed-tensors' own forward (transformers loading the checkpoint as stored) cannot run;
    [] for a checkpoint in another format (DeepSeek-native FP8: transformers' own FP8 path)."""
    if st.qc.get("quant_method") != "compressed-tensors":
        return []
    return block_shape_problems("compressed-tensors", st, inventory(st, "vllm"))


def serving_folders(path: str | Path) -> list[Path]:
    """A checkpoint folder itself, or a convert output's prefill/ and decode/; an unfinished convert
    output (or one of its folders) is refused, with the command that finishes it: a pair whose
    convert did not finish is not one to serve."""
    from quantkit.checkpoint.unfinished import unfinished
    from quantkit.errors import IntegrityError

    path = Path(path)
    for folder in (path, path.parent):
        if why := unfinished(folder):
            raise IntegrityError(why)
    if (path / "config.json").is_file():
        return [path]
    pair = [path / "prefill", path / "decode"]
    if all((p / "config.json").is_file() for p in pair):
        return pair
    raise ConfigError(f"{path}: neither a checkpoint folder (config.json) nor a convert output (prefill/, decode/)")


def render(report: ServingReport):
    """Rich tables, one per engine: every module, what the checkpoint stores, the scheme the engine picks."""
    from rich.console import Group
    from rich.table import Table

    tables = []
    for e in report.engines:
        verdict = "loads" if e.loads else "REFUSES"
        how = "its own code" if e.source == "engine code" else "re-stated rules (engine code unavailable)"
        t = Table(title=f"{report.folder}: {e.engine} {e.version} {verdict} (checked with {how})")
        t.add_column("module", overflow="fold")
        t.add_column("stored")
        t.add_column("scheme", overflow="fold")
        t.add_column("tensors vs create_weights")
        for r in e.rows:
            checked = "match" if r.params_checked and r.ok else ("-" if not r.params_checked else "")
            scheme = r.scheme if r.ok else f"[red]{r.scheme}: {r.problem}[/red]"
            t.add_row(r.module, r.stored, scheme, checked)
        notes = [f"launch with {' '.join(f for f in e.flags if not f.startswith('#'))}"] if any(
            not f.startswith("#") for f in e.flags) else []
        if e.layout:
            lay = e.layout["layout"]
            notes.append(f"at --tp {lay['tp']} --ep {lay['ep']}{' --dp-attention' if lay['dp_attention'] else ''} "
                         f"on {lay['gpu']}: " + ("every rank's shards pass" if e.layout["ok"] else "REFUSED")
                         + "".join(f"; {k}: {v}" for k, v in e.layout["kernels"].items()))
        notes += [p for p in e.problems if not any(p.startswith(r.module + ":") for r in e.rows)]
        t.caption = "; ".join(notes) or None
        tables.append(t)
    if report.compressed_tensors:
        tables.append("[red]transformers (compressed-tensors forward) cannot run:[/red] " + "; ".join(report.compressed_tensors))
    return Group(*tables)
