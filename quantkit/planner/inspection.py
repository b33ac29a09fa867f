"""`quantkit inspect`: what a checkpoint holds, by tensor class and storage format, without loading it.

Only shard headers are read (and the tiny `weight_shape` tensors of INT4 weights), so inspecting a
1.5 TB checkpoint takes seconds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.checkpoint.reader import Checkpoint, Stored


def storage_format(st: Stored, ckpt: Checkpoint) -> str:
    """A short name for how a tensor is stored: `int4-g32`, `fp8-block128`, `bf16`, ..."""
    if st.format == "int4":
        scale = ckpt.headers[ckpt.weight_map[st.parts["weight_scale"]]][st.parts["weight_scale"]]["shape"]
        sym = "" if "weight_zero_point" not in st.parts else "-asym"
        return f"int4-g{st.shape[1] // scale[1]}{sym}"
    if st.format == "fp8":
        block = (ckpt.arch.quantization_config or {}).get("weight_block_size", [128, 128])
        return f"fp8-block{block[0]}"
    return st.dtype.lower()


@dataclass
class ClassSummary:
    tensors: int = 0
    params: int = 0
    bytes: int = 0
    formats: Counter = field(default_factory=Counter)


@dataclass
class Inspection:
    """Result of `inspect`: JSON for scripts, a table for terminals and notebooks."""

    path: str
    model_type: str
    family: str
    layers: int
    mtp_layers: int
    routed_experts: int
    shards: int
    params: int
    bytes: int
    classes: dict[str, ClassSummary]

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("path", "model_type", "family", "layers", "mtp_layers", "routed_experts", "shards", "params", "bytes")}
        d["classes"] = {
            k: {"tensors": c.tensors, "params": c.params, "bytes": c.bytes, "formats": dict(c.formats)} for k, c in self.classes.items()
        }
        return d

    def table(self):
        from rich.table import Table

        t = Table(title=f"{self.path}  ({self.model_type}, {self.layers} layers + {self.mtp_layers} MTP, {self.shards} shards)")
        for col in ("class", "tensors", "params", "bytes", "storage"):
            t.add_column(col, justify="left" if col in ("class", "storage") else "right")
        for k, c in sorted(self.classes.items(), key=lambda kv: -kv[1].bytes):
            t.add_row(k, f"{c.tensors:,}", _human(c.params, ""), _human(c.bytes, "B"), ", ".join(f"{f} ({n})" for f, n in c.formats.most_common()))
        t.add_row("total", "", _human(self.params, ""), _human(self.bytes, "B"), "", style="bold")
        return t

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{k}</td><td>{c.tensors}</td><td>{_human(c.params, '')}</td><td>{_human(c.bytes, 'B')}</td>"
            f"<td>{', '.join(f'{f} ({n})' for f, n in c.formats.most_common())}</td></tr>"
            for k, c in self.classes.items()
        )
        return f"<b>{self.path}</b> ({self.model_type})<table><tr><th>class</th><th>tensors</th><th>params</th><th>bytes</th><th>storage</th></tr>{rows}</table>"


def _human(n: int, unit: str) -> str:
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.3g}{suffix}{unit}" if suffix else f"{n}{unit}"
        n /= 1000
    return f"{n:.3g}P{unit}"


def inspect_preset(name: str) -> Inspection:
    """The same summary for a real model from its shipped config (quantkit.model.arch presets), without
    weights: tensor shapes from the architecture, storage from its quantization_config."""
    from quantkit.model.arch import arch_from_config, load_preset
    from quantkit.model.inventory import tensor_inventory, vision_params
    from quantkit.planner.capacity import source_format

    cfg = load_preset(name)
    a = arch_from_config(cfg, source=f"preset {name}")
    fmt = source_format(a)
    vision = vision_params(cfg) if a.definition.vision else 0
    classes: dict[str, ClassSummary] = defaultdict(ClassSummary)
    for spec in tensor_inventory(a, vision_params=vision, mtp_embed_copies=a.definition.mtp_embed_copies):
        c = classes[spec.klass.value]
        c.tensors += spec.count
        c.params += spec.params
        c.bytes += fmt.bytes(spec)
        label = _preset_label(spec, fmt)
        c.formats[label] += spec.count
    return Inspection(
        path=f"preset:{name}", model_type=a.model_type, family=a.family, layers=a.num_hidden_layers,
        mtp_layers=a.num_mtp_layers, routed_experts=a.n_routed_experts, shards=0,
        params=sum(c.params for c in classes.values()), bytes=sum(c.bytes for c in classes.values()), classes=dict(classes),
    )


def _preset_label(spec, fmt) -> str:
    b = fmt.bytes(spec)
    if spec.role == "e_score_correction_bias":
        return "f32"
    if b == 2 * spec.params:
        return "bf16"
    if b < spec.params:
        return f"int4-g{fmt.group_size}"
    return "fp8-block128"


def inspect(model: str | Path, *, allow_unverified: bool = False) -> Inspection:
    """Summarise a model folder, tiny id, hf:// id (headers only) or preset name
    (`model.arch.preset_names()`: from the real config, no weights): family, layers, params and bytes per
    class, storage format."""
    from quantkit.planner.target import resolve_target

    target = resolve_target(model, allow_unverified=allow_unverified)
    if target.preset:
        return inspect_preset(target.preset)
    ckpt = target.checkpoint
    if ckpt is None:  # a config.json alone: no shards to summarise
        from quantkit.errors import ConfigError

        raise ConfigError(f"{model}: inspect reads a checkpoint's shards; give its folder (or a preset name)")
    classes: dict[str, ClassSummary] = defaultdict(ClassSummary)
    for name, st in ckpt.tensors.items():
        c = classes[st.info.klass.value]
        c.tensors += 1
        n = 1
        for d in st.shape:
            n *= d
        c.params += n
        c.bytes += ckpt.storage_bytes(name)
        c.formats[storage_format(st, ckpt)] += 1
    a = ckpt.arch
    return Inspection(
        path=str(model), model_type=a.model_type, family=a.family, layers=a.num_hidden_layers, mtp_layers=a.num_mtp_layers,
        routed_experts=a.n_routed_experts, shards=len(ckpt.headers), params=sum(c.params for c in classes.values()),
        bytes=sum(c.bytes for c in classes.values()), classes=dict(classes),
    )
