"""Which serving layouts the pair `quantkit convert` would write can run at: `quantkit plan` checks the
TP size it plans for with check-serving's per-rank kernel rules (quantkit.serving.layout), on the
checkpoints predicted from config.json, and recommends only a layout that passes."""

from __future__ import annotations

from pathlib import Path

from quantkit.model.arch import load_config
from quantkit.model.presets import load_preset
from quantkit.serving.layout import GPU_SM, Layout, check_layout, predicted_stored, working_layout

ENGINES = ("vllm", "sglang")


def raw_config(model: str | Path | dict) -> dict:
    """config.json of a plan's model (a preset, a folder holding config.json, or the dict itself)."""
    if isinstance(model, dict):
        return model
    path = Path(model)
    if isinstance(model, Path) or path.is_dir() or "/" in str(model) or str(model).endswith(".json"):
        return load_config(path.parent if path.name == "config.json" else path)
    return load_preset(str(model))


def serving_layouts(config: dict, *, tp: int, gpu: str, group_size: int, bf16_projs: tuple[str, ...] = (),
                    dp_attention: bool = False) -> dict:
    """The planned layout checked for both engines on the predicted prefill and decode checkpoints:
    {"checked", "passes", "problems", "kernels", "recommended"} ("recommended": the layout itself when
    it passes, else the nearest one that does, else None). {} for a GPU neither engine targets."""
    if gpu not in GPU_SM:
        return {}
    layout = Layout(tp, 1, dp_attention, gpu)
    stored = [predicted_stored(config, phase, group_size=group_size, bf16_projs=bf16_projs)
              for phase in ("prefill", "decode")]
    reports = [check_layout(st, layout, e) for st in stored for e in ENGINES]
    passes = all(r.ok for r in reports)
    found = layout if passes else working_layout(stored, layout, ENGINES)
    problems = [f"{r.engine}: {p.text(r.engine)}" for r in reports for p in r.problems]
    kernels = {f"{r.engine} {k}": v for r in reports for k, v in r.kernels.items()}
    return {"checked": layout.flags(), "passes": passes, "problems": problems, "kernels": kernels,
            "recommended": found.flags() if found else None}


def layout_note(s: dict) -> str | None:
    """One line for the plan's notes."""
    if not s:
        return None
    if s["passes"]:
        return (f"serving at {s['checked']}: every rank's shards keep vLLM's and SGLang's kernel rules "
                f"(quantkit check-serving DIR {s['checked']})")
    rec = f"recommended: {s['recommended']}" if s["recommended"] else "no layout of these GPUs passes"
    return f"serving at {s['checked']} is refused ({s['problems'][0]}); {rec}"
