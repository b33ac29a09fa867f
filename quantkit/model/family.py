"""What a model family declares, in one place: the shape of a definition under `quantkit.model.families`.

A family is what differs between checkpoints that quantkit otherwise treats alike: where the text
model sits in config.json and in the tensor names, which attention and router it runs, which
optional layer kinds it has (shared experts, a dense prefix, MTP, the DSA indexer), what its
attention projections are called and how the engines fuse them, which tensors its published
conversions keep BF16, and which shipped recipe and presets belong to it. Every stage reads these
fields through `ModelArch.definition`; no module outside `quantkit.model` tests a family name or a
model_type (tests/model/test_families.py greps for it), so a new family is a new definition module
and one registry line (`quantkit.model.families`), not an edit in every stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quantkit.model.attention import Attention

# ModelArch -> {leaf: [out, in]}; typed Any because quantkit.model.arch imports the definitions
Shapes = Callable[[Any], dict[str, tuple[int, ...]]]
# (x (N, D), layer weights, ModelArch) -> top-k expert ids (N, k) and their raw float32 weights (N, k);
# quantkit.model.moe.route then applies norm_topk_prob and routed_scaling_factor
Router = Callable[[Any, dict, Any], tuple[Any, Any]]


@dataclass(frozen=True)
class EngineModule:
    """One attention module as an engine builds it from stored projections (vLLM's and SGLang's
    model classes): its runtime name and class, and the stored projections it loads, all relative
    to the layer's `self_attn.`. Several shards are fused into one module (`packed_modules_mapping`)."""

    engines: tuple[str, ...]  # "sglang", "vllm"
    name: str
    klass: str  # ReplicatedLinear, ColumnParallelLinear, ...
    shards: tuple[str, ...]
    single: bool = False  # the shards concatenate into one output (SGLang's fused_qkv_a_proj_with_mqa)
    # how tensor parallelism splits it when its class does not say: "replicated" for a parallel class
    # built with TP disabled; "" splits it as the class does (quantkit.serving.layout.PARALLEL)
    tp_split: str = ""


@dataclass(frozen=True)
class Family:
    """One model family's declarations (module docstring); one instance per config.json model_type."""

    # what every family states
    model_type: str  # config.json's outer model_type
    name: str  # the family ("deepseek_v3", "kimi", "glm"): ModelArch.family, reports and plans
    description: str
    attention: Attention  # the attention kind (quantkit.model.attention), defined by the family that introduced it
    router: Router  # the router's scores and top-k choice, defined by the family that introduced it
    attention_projections: tuple[str, ...]  # the attention Linears (leaves under `self_attn.`), in layer order
    attention_shapes: Shapes  # leaf -> [out, in] of every attention (and `indexer.`) Linear, from the arch
    engine_attention: tuple[EngineModule, ...]  # how vLLM and SGLang build the attention modules

    # The rest defaults to the common case (a text-only "model." checkpoint with "lm_head.weight",
    # no indexer, nothing kept BF16 beyond the norms and the router); a definition states what differs.
    # naming: where the text model sits
    text_config: str | None = None  # the config key nesting the text model (Kimi K2.5+: "text_config"), or None
    prefix: str = "model."  # decoder tensor prefix: "model." or "language_model.model."
    head_name: str = "lm_head.weight"  # or "language_model.lm_head.weight"
    vision: bool = False  # a vision tower ships beside the text model (carried byte for byte)

    # layer kinds
    router_bias: bool = False  # the router stores a correction bias (`mlp.gate.e_score_correction_bias`)
    indexer: bool = False  # DeepSeek Sparse Attention's lightning indexer (GLM), per layer or shared (IndexShare)
    forced_rope_interleave: bool | None = None  # the modelling code's rope layout when it ignores the config
    # config.json keys, beyond every family's (quantkit.checkpoint.pair.CONFIG_FIELDS), that decide what a
    # cached KV page means: the attention's heads or ranks, the indexer's; the pair's contract compares them
    cache_config: tuple[str, ...] = ()

    # tensor naming (leaves under `self_attn.`)
    attention_norms: tuple[tuple[str, str], ...] = ()  # (norm leaf, the ModelArch size field it spans)
    indexer_projections: tuple[str, ...] = ()  # the indexer Linears (under self_attn.indexer.)
    replicated: tuple[str, ...] = ()  # attention Linears every TP rank holds whole (the indexer's always are)

    # precision defaults and the published checkpoints' conventions
    prefill_bf16_projections: tuple[str, ...] = ()  # attention Linears published FP8 conversions keep BF16
    always_bf16: tuple[str, ...] = ()  # Linears no checkpoint stores FP8 (GLM's indexer weights_proj)
    mtp_embed_copies: bool = False  # the MTP layer stores its own embed_tokens and shared_head.head
    trust_remote_code: bool = False  # the tokenizer (or model) ships its own code
    # how the chat model writes a tool call in its text (quantkit.validation.toolcalls.SYNTAXES): "hermes"
    # (<tool_call>{json}</tool_call>), "kimi_sections" (Kimi K2), "glm45" (<arg_key>/<arg_value>) or "deepseek_fences"
    tool_calls: str = "hermes"

    # what ships with quantkit
    recipe: str | None = None  # the shipped recipe `convert` uses by default (None: none yet, --recipe needed)
    presets: tuple[str, ...] = ()  # shipped config.json presets (quantkit.model.presets)
    # the text config in DeepSeek-V3's field names, for a family whose config.json names them otherwise
    config_view: Callable[[dict], dict] | None = None

    @property
    def recipe_projections(self) -> tuple[str, ...]:
        """What a recipe's `prefill.keep_bf16` may name for this family."""
        return self.attention_projections + tuple(p for p in self.indexer_projections if p not in self.always_bf16)

    def fused(self) -> dict[tuple[str, ...], tuple[str, ...]]:
        """Stored attention shards -> the names of the modules engines fuse them into."""
        out: dict[tuple[str, ...], list[str]] = {}
        for m in self.engine_attention:
            if len(m.shards) > 1:
                out.setdefault(m.shards, []).append(m.name)
        return {k: tuple(v) for k, v in out.items()}

    def packed(self, engine: str) -> dict[str, list[str]]:
        """An engine's `packed_modules_mapping` entries for the attention: fused name -> shards."""
        return {m.name: list(m.shards) for m in self.engine_attention if engine in m.engines and len(m.shards) > 1}
