"""A checkpoint as the engines see it: its config, quantization config and tensors' names, dtypes
and shapes (`Stored`, read without the bytes), and the modules each engine builds from it
(`inventory`). Shared by the engine check (quantkit.serving.checks) and the per-rank layout check
(quantkit.serving.layout), which both read it; it imports neither."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import CheckpointError, ConfigError
from quantkit.model.families import family_of

TORCH_DTYPES = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "F16": "float16", "F32": "float32",
                "I32": "int32", "I64": "int64", "I8": "int8", "U8": "uint8"}


@dataclass
class Module:
    """One module an engine builds with the checkpoint's quantization config."""

    name: str  # the engine's runtime name
    klass: str  # the engine's class name
    kind: str  # linear | moe | lm_head
    shards: list[str]  # stored module names it loads (fused: each shard; moe: each expert's projections)
    stored: str  # int4 | fp8 | bf16: how the checkpoint stores it
    create: dict | None = None  # sizes for create_weights
    tp_split: str = ""  # how TP splits it when its class does not say (quantkit.model.family.EngineModule)
    single: bool = False  # the shards concatenate into one output (EngineModule.single)


# ---- the checkpoint as stored --------------------------------------------------------------------
@dataclass
class Stored:
    """A checkpoint folder's configs and tensor headers (`read_stored`), or a predicted one
    (quantkit.serving.layout.predicted_stored): what the engine and layout checks read."""

    config: dict
    text: dict  # the text model's config (Kimi: text_config)
    qc: dict
    tensors: dict[str, tuple[str, list[int]]]  # name -> (dtype, shape)


def read_stored(folder: Path) -> Stored:
    """The configs and every tensor's (dtype, shape) of a checkpoint folder, from the safetensors headers."""
    from safetensors import safe_open

    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path}: not found; pass a checkpoint folder (DIR/prefill or DIR/decode)")
    config = json.loads(cfg_path.read_text())
    text = config.get("text_config", config)
    qc = config.get("quantization_config") or text.get("quantization_config")
    if not qc:
        raise ConfigError(f"{cfg_path}: no quantization_config; nothing for an engine to resolve")
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    tensors = {}
    for f in files:
        path = folder / f
        if not path.is_file():
            raise CheckpointError("listed in the index but missing", file=str(path))
        with safe_open(str(path), framework="pt") as sf:
            for n in sf.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                sl = sf.get_slice(n)
                tensors[n] = (TORCH_DTYPES.get(sl.get_dtype(), sl.get_dtype()), list(sl.get_shape()))
    return Stored(config, text, qc, tensors)


def stored_format(st: Stored, module: str) -> str:
    """How the checkpoint stores `module`: int4 (packed), fp8 (scaled) or bf16."""
    if f"{module}.weight_packed" in st.tensors:
        return "int4"
    if f"{module}.weight_scale_inv" in st.tensors or f"{module}.weight_scale" in st.tensors:
        return "fp8"
    return "bf16"


def inventory(st: Stored, engine: str) -> list[Module]:
    """The modules `engine` builds with the quantization config (names and what is left out are cited in
    quantkit.serving.checks' module docstring)."""
    text = st.text
    fam = family_of(st.config.get("model_type"))
    n_layers = int(text["num_hidden_layers"])
    n_mtp = int(text.get("num_nextn_predict_layers") or 0)
    lp = "language_model.model." if any(n.startswith("language_model.model.") for n in st.tensors) else "model."
    mods: list[Module] = []

    def shape(m):
        return st.tensors.get(f"{m}.weight", st.tensors.get(f"{m}.weight_packed", (None, None)))[1]

    def true_shape(m):
        if f"{m}.weight_shape" in st.tensors:
            return None  # int4: the real shape is stored as a tensor; create sizes come from fp8/bf16 peers
        return shape(m)

    def linear(runtime, klass, shards, single=False, tp_split=""):
        shards = [s for s in shards if shape(s) is not None]
        if not shards:
            return
        fmts = {stored_format(st, s) for s in shards}
        sizes = [true_shape(s) for s in shards]
        create = None
        if all(sizes):
            outs = [s[0] for s in sizes]
            create = {"input_size": sizes[0][1], "output_sizes": [sum(outs)] if single else outs}
        mods.append(Module(runtime, klass, "linear", shards, fmts.pop() if len(fmts) == 1 else "mixed", create,
                           tp_split, single))

    for layer in range(n_layers + n_mtp):
        sp = f"{lp}layers.{layer}."
        if engine == "sglang":
            rp = "model.decoder." if layer >= n_layers else f"model.layers.{layer}."
        else:
            rp = sp
        a = "self_attn."
        for m in fam.engine_attention:  # as the family's definition says the engine builds them
            if engine in m.engines:
                linear(rp + a + m.name, m.klass, [sp + a + s for s in m.shards], single=m.single, tp_split=m.tp_split)
        experts = sorted({n.rsplit(".", 2)[0] for n in st.tensors if n.startswith(sp + "mlp.experts.")},
                         key=lambda m: int(m.rsplit(".", 1)[1]))
        if experts:
            shards = [f"{e}.{p}" for e in experts for p in ("gate_proj", "up_proj", "down_proj")]
            fmts = {stored_format(st, s) for s in shards}
            create = None
            if f"{experts[0]}.down_proj.weight_shape" in st.tensors or shape(f"{experts[0]}.gate_proj"):
                inter, hidden = expert_dims(st, experts[0])
                create = {"num_experts": len(experts), "hidden_size": hidden, "intermediate_size": inter}
            mods.append(Module(rp + "mlp.experts", "FusedMoE", "moe", shards, fmts.pop() if len(fmts) == 1 else "mixed", create))
            mlp = "mlp.shared_experts."
        else:
            mlp = "mlp."
        linear(rp + mlp + "gate_up_proj", "MergedColumnParallelLinear", [sp + mlp + "gate_proj", sp + mlp + "up_proj"])
        linear(rp + mlp + "down_proj", "RowParallelLinear", [sp + mlp + "down_proj"])
    head = "language_model.lm_head" if lp != "model." else "lm_head"
    if shape(head) is not None:
        runtime = "lm_head" if engine == "sglang" else head
        mods.append(Module(runtime, "ParallelLMHead", "lm_head", [head], stored_format(st, head)))
    return mods


def expert_dims(st: Stored, expert: str) -> tuple[int, int]:
    """(intermediate, hidden) of one routed expert, from its gate projection."""
    sh = f"{expert}.gate_proj.weight_shape"
    if sh in st.tensors:  # pack-quantized: eight values per int32 along the input dim
        _, s = st.tensors[f"{expert}.gate_proj.weight_packed"]
        return s[0], s[1] * 8
    out, inp = st.tensors[f"{expert}.gate_proj.weight"][1]
    return out, inp
