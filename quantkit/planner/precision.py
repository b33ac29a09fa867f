"""What the prefill/decode pair looks like: one decision per source tensor, and each output's config.

The pair shares every tensor except the routed experts, byte for byte, so both pools compute the
same KV cache from the same hidden states:

    tensor class                     prefill (FP8)                 decode (INT4)
    routed experts                   FP8 128x128 block             INT4 group-G symmetric (GPTQ/AWQ/RTN,
                                                                   or the source's INT4 reused)
    attention, indexer wq_b/wk,      FP8 block, or BF16 where a projection cannot be blocked the way
    shared experts, dense MLP        engines need (Kimi's q_a_proj, kv_a_proj_with_mqa) or cannot run
                                     as FP8 blocks at all (an input dim not a multiple of the block,
                                     e.g. kv_b_proj at kv_lora_rank 64: formats.fp8.cannot_run; a
                                     source FP8 tensor is then dequantized): same in both
    router, bias, norms, embeddings, as stored in the source, byte for byte: same in both
    head, vision, MTP extras

A tensor already stored as FP8 blocks in the source (GLM-5.2) passes through untouched. The prefill
checkpoint uses DeepSeek's native FP8 layout (`weight_scale_inv`, `quant_method: fp8`); the decode
checkpoint is compressed-tensors (INT4 `pack-quantized` experts + an FP8 block group), which names
the same FP8 multiplier `weight_scale`: identical bytes under the name each loader expects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from quantkit.checkpoint.reader import Checkpoint, Stored
from quantkit.errors import ConfigError
from quantkit.formats import fp8, int4
from quantkit.model.arch import ModelArch
from quantkit.model.tensors import TensorClass

if TYPE_CHECKING:
    from quantkit.recipe import Recipe


# Storage actions
PASS = "pass"  # copy the stored tensors byte for byte
FP8 = "fp8"  # (re)quantize to FP8 128x128 blocks
BF16 = "bf16"  # dequantize and store BF16
INT4 = "int4"  # quantize to INT4 (decode experts)
REUSE_INT4 = "reuse-int4"  # copy the source's INT4 tensors (same scheme)


@dataclass(frozen=True)
class Decision:
    prefill: str
    decode: str
    why: str = ""


def _fp8_or_pass(st: Stored) -> str:
    return PASS if st.format == "fp8" else FP8


def decide(st: Stored, recipe: Recipe, group_size: int, source_group: int | None, always_bf16: tuple[str, ...] = ()) -> Decision:
    """Where one source tensor goes in each output; pure, so a dry run can check every name.
    `always_bf16`: the projections the model family never stores FP8 (its definition's)."""
    d = _decide_both(st, recipe, group_size, source_group, always_bf16)
    info = st.info
    linear = info.is_linear and info.klass in (TensorClass.ATTENTION, TensorClass.INDEXER, TensorClass.SHARED_EXPERT,
                                               TensorClass.DENSE_MLP) and info.proj not in always_bf16
    if linear and recipe.decode.rest == "bf16" and stored_as(d.decode, st) != "dense":
        # decode.rest: bf16 (Kimi's official look): the decode pool's non-expert weights differ from prefill's
        return Decision(d.prefill, BF16, "recipe decode.rest: bf16")
    return d


def _decide_both(st: Stored, recipe: Recipe, group_size: int, source_group: int | None, always_bf16: tuple[str, ...]) -> Decision:
    info = st.info
    k = info.klass
    if k == TensorClass.ROUTED_EXPERT:
        prefill = _fp8_or_pass(st)
        reuse = st.format == "int4" and source_group == group_size and "weight_zero_point" not in st.parts
        if reuse and recipe.decode.reuse_source_int4:
            return Decision(prefill, REUSE_INT4, "source INT4 in the target scheme")
        return Decision(prefill, INT4)
    linear = info.is_linear and k in (TensorClass.ATTENTION, TensorClass.INDEXER, TensorClass.SHARED_EXPERT, TensorClass.DENSE_MLP)
    if linear and info.proj not in always_bf16:
        if why := fp8.cannot_run(st.shape, recipe.prefill.fp8_block):
            # decided here, before any work: a source FP8 tensor of this shape is dequantized to BF16
            # (the dtype engines compute an unquantized Linear in), a BF16 one kept as stored; in both
            # outputs, so the pair still shares it byte for byte
            return Decision(BF16 if st.format != "dense" else PASS, BF16 if st.format != "dense" else PASS,
                            f"BF16 in both outputs: {why}")
        if st.format == "fp8":
            return Decision(PASS, PASS, "source FP8")
        setting = {TensorClass.SHARED_EXPERT: recipe.prefill.shared_experts, TensorClass.DENSE_MLP: recipe.prefill.dense_mlp}.get(k, "fp8")
        if setting == "bf16":
            return Decision(BF16 if st.format != "dense" else PASS, BF16 if st.format != "dense" else PASS, "recipe keeps BF16")
        if info.proj in recipe.prefill.keep_bf16:
            return Decision(PASS, PASS, "recipe keeps BF16 (engines fuse it with a projection that breaks 128-blocks)")
        if not fp8.can_block(st.shape, recipe.prefill.fp8_block):
            return Decision(PASS, PASS, f"shape {st.shape} is not a multiple of {recipe.prefill.fp8_block}")
        return Decision(FP8, FP8)
    return Decision(PASS, PASS)


def module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def stored_as(decision: str, st: Stored) -> str:
    """The storage format a decision produces: fp8 / int4 / dense."""
    if decision == PASS:
        return st.format
    return {FP8: "fp8", BF16: "dense", INT4: "int4", REUSE_INT4: "int4"}[decision]


def _linear_modules(ckpt: Checkpoint, decisions: dict[str, Decision], which: str, fmt: str) -> list[str]:
    out = []
    for name, st in ckpt.tensors.items():
        if not name.endswith(".weight") or len(st.shape) != 2 or st.info.klass in (TensorClass.NORM, TensorClass.EMBEDDING):
            continue
        if stored_as(getattr(decisions[name], which), st) == fmt:
            out.append(module_of(name))
    return sorted(out)


def _short(module: str, arch: ModelArch) -> str:
    """`language_model.model.layers.3.mlp.gate` -> `layers.3.mlp.gate`, `language_model.lm_head` ->
    `lm_head`: loaders rename the prefix (transformers loads Kimi's text model as
    `model.language_model.` and its head as `lm_head`), the rest stays."""
    wrapper = arch.prefix[: -len("model.")]  # "language_model." for Kimi, "" otherwise
    for p in (arch.prefix, wrapper):
        if p and module.startswith(p):
            return module[len(p):]
    return module


def _vision(module: str) -> bool:
    return module.startswith(("vision_tower.", "mm_projector.", "multi_modal_projector."))


# Fused modules the engines build from two stored projections: the attention's come from the model
# family's definition (MLA: SGLang `fused_qkv_a_proj_with_mqa` and vLLM `fused_qkv_a_proj` in
# deepseek_v2.py), `gate_up_proj` is every MLP's. A fused module is in one scheme only when both
# shards are, so its name is listed only when both shards are.
MLP_FUSED = {("gate_proj", "up_proj"): ("gate_up_proj",)}
# The MTP layer's extras that SGLang's draft model (deepseek_nextn.py) keeps at `model.`, not
# under `model.decoder.` with the rest of the layer.
MTP_EXTRAS = ("eh_proj", "enorm", "hnorm", "shared_head")


def engine_names(modules: list[str], arch: ModelArch) -> list[str]:
    """`modules` (stored names) plus the names engines give them at runtime: the fused modules whose
    shards are all listed, and for MTP layers SGLang's draft names (`model.decoder.<rest>`, or
    `model.<extra>` for eh_proj & co.; vLLM keeps `model.layers.N.`)."""
    listed = set(modules)
    out = set(modules)
    fused_modules = arch.definition.fused() | MLP_FUSED
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        for shards, fused in fused_modules.items():
            if leaf == shards[0] and all(f"{parent}.{s}" in listed for s in shards):
                out |= {f"{parent}.{f}" for f in fused}
    for m in list(out):
        if not m.startswith(arch.prefix):
            continue  # vision towers and the head: no MTP naming
        hit = re.match(r"^(.*?)layers\.(\d+)\.(.*)$", m)
        if hit and int(hit.group(2)) >= arch.num_hidden_layers:
            rest = hit.group(3)
            out.add(f"{hit.group(1)}{rest}" if rest.startswith(MTP_EXTRAS) else f"{hit.group(1)}decoder.{rest}")
    return sorted(out)


def ct_patterns(modules: list[str], arch: ModelArch) -> list[str]:
    """compressed-tensors `re:` patterns matching exactly these modules (and the engines' runtime
    names for them, see `engine_names`) under any loader's prefix. Vision modules (renamed freely
    by loaders) are covered by one pattern per tower."""
    out = {f"re:(^|.*\\.){re.escape(_short(m, arch))}$" for m in engine_names(modules, arch) if not _vision(m)}
    out |= {f"re:.*{m.split('.')[0]}.*" for m in modules if _vision(m)}
    return sorted(out)


def prefill_quantization_config(ckpt: Checkpoint, decisions: dict[str, Decision], block: int) -> dict:
    """DeepSeek-native FP8 config; every 2-D weight not stored FP8 is listed as not converted.

    Names are listed as stored and, where the decoder prefix is not `model.` (Kimi), also without
    it: transformers matches by suffix on its renamed modules, vLLM and SGLang by stored name.
    Fused and MTP runtime names are listed too (`engine_names`).
    """
    not_fp8 = {m for fmt in ("dense", "int4") for m in _linear_modules(ckpt, decisions, "prefill", fmt)}
    not_fp8 = set(engine_names(sorted(not_fp8), ckpt.arch))
    if ckpt.arch.prefix != "model.":
        not_fp8 |= {_short(m, ckpt.arch) for m in not_fp8}
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
        "modules_to_not_convert": sorted(not_fp8),
    }


EXPERTS_TARGET = r"re:.*mlp\.experts\..*"


def fp8_block_group(block: int) -> dict:
    """compressed-tensors FP8 block scheme: e4m3 weights with one multiplier per block x block,
    activations quantized per token-group at run time (what DeepSeek-native FP8 means)."""
    return {
        "targets": ["Linear"],
        "weights": {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
            "block_structure": [block, block], "dynamic": False, "observer": "minmax",
        },
        "input_activations": {
            "num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
            "group_size": block, "dynamic": True, "observer": None,
        },
        "output_activations": None,
        "format": "float-quantized",
    }


def decode_quantization_config(ckpt: Checkpoint, decisions: dict[str, Decision], group_size: int, block: int) -> dict:
    """compressed-tensors config both engines load (checked by running their code, tests/serving/test_serving.py).

    - top-level `format: pack-quantized`: SGLang's W4A16 MoE schemes check the top-level format,
      not the group's (`CompressedTensorsWNA16MoE.__init__`); vLLM and compressed-tensors use each
      group's own `format`, so the FP8 group still decompresses as `float-quantized`.
    - the FP8 block group targets `Linear`: SGLang matches a module's class name before expanding
      fused modules (`find_matched_target`), so the group owning `Linear` is the one fused
      `gate_up_proj` / `fused_qkv_a_proj_with_mqa` get, and SGLang reads `weight_block_size` only
      from it (`CompressedTensorsConfig.weight_block_size`).
    - the INT4 group targets the routed experts by pattern only, which matches every engine's
      per-expert names (MTP draft layers included).
    - without FP8 modules (`decode.rest: bf16`) the INT4 group targets `Linear` as well: Kimi's
      official layout, everything else in `ignore`.
    BF16 modules are listed in `ignore` under their stored and runtime names (`engine_names`).
    """
    fp8_modules = _linear_modules(ckpt, decisions, "decode", "fp8")
    bf16_modules = _linear_modules(ckpt, decisions, "decode", "dense")
    cfg = int4.quantization_config(group_size, ignore=ct_patterns(bf16_modules, ckpt.arch))
    int4_group = cfg["config_groups"]["group_0"]
    if fp8_modules:
        int4_group["targets"] = [EXPERTS_TARGET]
        cfg["config_groups"]["group_1"] = fp8_block_group(block)
    else:
        # Name the routed experts explicitly too: transformers picks the experts' scheme as the first
        # group with an `re:` target mentioning "experts".
        int4_group["targets"].append(EXPERTS_TARGET)
    return cfg


def precision_summary(ckpt: Checkpoint, decisions: dict[str, Decision], which: str, group_size: int, block: int) -> dict[str, str]:
    """Per tensor class, the storage formats in one output (for the report and the model card)."""
    names = {"fp8": f"fp8-block{block}", "int4": f"int4-g{group_size}-sym"}
    summary: dict[str, set[str]] = {}
    for name, st in ckpt.tensors.items():
        fmt = stored_as(getattr(decisions[name], which), st)
        label = names.get(fmt, st.dtype.lower() if fmt == "dense" and getattr(decisions[name], which) == PASS else "bf16")
        if fmt == "int4" and getattr(decisions[name], which) == PASS:
            label = "int4 (source)"
        summary.setdefault(st.info.klass.value, set()).add(label)
    return {k: ", ".join(sorted(v)) for k, v in sorted(summary.items())}


def set_quantization_config(config: dict, arch: ModelArch, qc: dict) -> dict:
    """A copy of the source config.json with `qc` as its quantization_config (Kimi: top level and
    text_config, where different loaders look)."""
    import copy

    out = copy.deepcopy(config)
    out.pop("quantization_config", None)
    if "text_config" in out:
        out["text_config"].pop("quantization_config", None)
        out["text_config"]["quantization_config"] = qc
    out["quantization_config"] = qc
    return out


def source_int4_group(arch) -> int | None:
    """The group size of a compressed-tensors symmetric INT4 source (Kimi: 32), else None."""
    qc = arch.quantization_config or {}
    if qc.get("quant_method") != "compressed-tensors":
        return None
    for group in qc.get("config_groups", {}).values():
        wts = group.get("weights") or {}
        if wts.get("num_bits") == 4 and wts.get("symmetric", True):
            return wts.get("group_size")
    return None


def predicted_bytes(ckpt: Checkpoint, decisions: dict[str, Decision], G: int) -> tuple[int, int]:
    """(prefill, decode) bytes the decisions will write, from the shapes alone."""
    sizes = [0, 0]
    for name, d in decisions.items():
        st = ckpt.tensors[name]
        n = 1
        for s in st.shape:
            n *= s
        for i, action in enumerate((d.prefill, d.decode)):
            if action in (PASS, REUSE_INT4):
                sizes[i] += ckpt.storage_bytes(name)
            elif action == FP8:
                sizes[i] += n + 4 * -(-st.shape[0] // 128) * -(-st.shape[1] // 128)
            elif action == BF16:
                sizes[i] += 2 * n
            else:
                sizes[i] += n // 2 + 2 * n // G
    return sizes[0], sizes[1]


def layer_experts(ckpt: Checkpoint, decisions: dict[str, Decision], layer: int) -> tuple[dict[int, list[str]], set[int]]:
    """A layer's routed experts: {expert: its tensor names}, and the experts decode stores as new INT4."""
    by_expert: dict[int, list[str]] = {}
    for name in ckpt.names(layer, TensorClass.ROUTED_EXPERT):
        by_expert.setdefault(ckpt.tensors[name].info.expert, []).append(name)
    pre = ckpt.arch.layer_prefix(layer)
    return by_expert, {e for e in by_expert if decisions[f"{pre}mlp.experts.{e}.down_proj.weight"].decode == INT4}


def decide_all(ckpt: Checkpoint, rec: Recipe) -> dict[str, Decision]:
    """Every tensor's storage in both outputs under `rec`: what convert does, and what
    `plan --convert` sizes (one call, so the plan is the engine's own accounting)."""
    source_group = source_int4_group(ckpt.arch)
    keep = ckpt.arch.definition.always_bf16
    decisions = {n: decide(st, rec, rec.group_size, source_group, keep) for n, st in ckpt.tensors.items()}
    check_groups(ckpt, decisions, rec.group_size)
    return decisions


def check_groups(ckpt: Checkpoint, decisions: dict[str, Decision], group_size: int) -> None:
    """Before any work: every expert INT4 quantizes must split its input columns into whole groups
    (else GPTQ would stop at that layer, hours in). Names the first tensor, its file and the fix."""
    for n, d in decisions.items():
        cols = ckpt.tensors[n].shape[-1]
        if d.decode == INT4 and cols % group_size:
            st = ckpt.tensors[n]
            divisors = [g for g in (128, 64, 32, 16) if cols % g == 0]
            fix = (f"pass --group-size {divisors[0]} (or a recipe whose group_size divides {cols})" if divisors else
                   f"no INT4 group size of 16-128 divides {cols}; this model's experts cannot be stored as grouped INT4")
            raise ConfigError(f"{ckpt.folder / ckpt.weight_map[next(iter(st.parts.values()))]}: {n} has {cols} input "
                              f"columns, not a multiple of the INT4 group size {group_size}; {fix}")


def needs_calibration(rec: Recipe) -> bool:
    """A calibrated method (quantkit.quant.methods.Method.calibrated) calibrates: the experts' Hessians
    need the tokens, and the FP8 KV cache's scales are measured on them too (quantkit.model.kvcache),
    so a source whose experts are all reused (Kimi's INT4) still gets its pass. A data-free convert
    (RTN) reads no data and carries no KV scales (engines then run the cache at 1.0)."""
    return rec.resolved_method.calibrated
