"""The published figures `quantkit plan` reproduces, and the comparison of a Plan with them.

Figures from the serving-economics article (Cloudflare's production notes on Kimi K2.6 and
GLM 5.2) and the facts sheet, with the unit each one is really in, and the plan() setup and
checkpoint kind that reproduce it. The article writes "GB" throughout, but its 705 / 88 for GLM
FP8 match the checkpoint in GiB (755.6 GB = 703.7 GiB), while 421 / 52 for INT4 match in GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.runtime.units import GB, GiB


@dataclass
class Comparison:
    figure: str
    unit: str
    article: float
    quantkit: float
    ratio: float  # quantkit / article
    source: str


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


def _metric(plan, f: Figure) -> float:
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


def compare_to_article(plan, preset: str | None = None) -> list[Comparison]:
    """quantkit's value / the published one for each figure of this model that the plan's setup
    reproduces (`plan`: a quantkit.planner.capacity.Plan)."""
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
