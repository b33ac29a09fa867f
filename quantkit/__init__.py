"""quantkit: offline quantization of trillion-parameter MoE checkpoints (Kimi K2.6, GLM 5.2).

One streaming pass turns a source checkpoint into a matched pair for disaggregated serving: an
FP8 checkpoint for the compute-bound prefill pool and an INT4-expert checkpoint for the
bandwidth-bound decode pool, then validates both against the source with quantkit's own
reference forward pass.

    import quantkit as qk
    qk.inspect("tiny:glm-5.2")
    qk.plan("glm-5.2")
    qk.logits("tiny:glm-5.2", input_ids)

The public API (each also a `quantkit` command; help(qk.<name>) for its arguments):

    inspect(model)            family, layers, parameters and bytes by tensor class, shard count
    plan(model)               checkpoint sizes, weight memory per GPU, KV cache and capacity
    pull(repo, out)           download a Hub repo at one pinned commit, every file checksum-verified
    convert(model, out)       the FP8 prefill and INT4 decode checkpoints from one streaming pass
    validate(dir)             measure a converted pair against its source; writes validation.json and cards
    verify(dir)               re-hash an output against its manifest.json
    check_serving(folder)     ask vLLM's and SGLang's own code whether they would load a checkpoint
    logits(model, input_ids)  quantkit's reference forward pass, one layer at a time
    Checkpoint(folder)        read a sharded safetensors checkpoint tensor by tensor
    QuantkitError             the base of every user-facing error (one line naming the file and the fix)

Heavy modules load on first use, so `import quantkit` is cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "inspect": ("quantkit.planner.inspection", "inspect"),
    "plan": ("quantkit.planner.capacity", "plan"),
    "logits": ("quantkit.validation.forward", "logits"),
    "convert": ("quantkit.conversion.pipeline", "convert"),
    "validate": ("quantkit.validation.pipeline", "validate"),
    "verify": ("quantkit.checkpoint.manifest", "verify"),
    "pull": ("quantkit.hub.download", "pull"),
    "check_serving": ("quantkit.serving.checks", "check_serving"),
    "Checkpoint": ("quantkit.checkpoint.reader", "Checkpoint"),
    "QuantkitError": ("quantkit.errors", "QuantkitError"),
}

__all__ = sorted(_API)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


def __getattr__(name: str):
    if name in _API:
        module, attr = _API[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
