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
    plan_convert(model)       what a convert will cost (memory, disk, time) and the settings that fit a budget
    plan_tasks(model, tasks)  what an lm-eval task run costs at full scale on source, prefill and decode
    pull(repo, out)           download a Hub repo at one pinned commit, every file checksum-verified
    convert(model, out)       the FP8 prefill and INT4 decode checkpoints from one streaming pass
    validate(dir)             measure a converted pair against its source; writes validation.json and cards
    verify(dir)               re-hash an output against its manifest.json
    check_serving(folder)     ask vLLM's and SGLang's own code whether they would load a checkpoint
    logits(model, input_ids)  quantkit's reference forward pass, one layer at a time
    Checkpoint(folder)        read a sharded safetensors checkpoint tensor by tensor
    QuantkitError             the base of every user-facing error (one line naming the file and the fix)

What they return (typed attributes for the headline numbers, `.to_json()` for everything):

    ConvertResult             convert's: .prefill, .decode, .method, .experts, .prefill_bytes, .decode_bytes,
                              .seconds, .validation (a ValidationResult), .report (convert-report.json)
    ValidationResult          validate's: .passed, .prefill / .decode / .cross_phase (RowMetrics), .rows,
                              .gates_passed, .gates_checked, .failed_gates, .data (validation.json)
    RowMetrics                one row's .kl, .top1, .ppl, .ppl_delta, .layer_rel_err, .greedy_agree
    VerifyResult              verify's: .ok, .problems, .files_checked, .shared_tensors

convert and validate take the same keyword names for what they share (gate, device, progress,
max_host_memory, max_gpu_memory). Progress goes to stderr; results are returned (and, from the
command line, printed on stdout).

Heavy modules load on first use, so `import quantkit` is cheap.
"""

__version__ = "0.1.0"

_API = {
    "inspect": ("quantkit.planner.inspection", "inspect"),
    "plan": ("quantkit.planner.capacity", "plan"),
    "plan_convert": ("quantkit.planner.cost", "plan_convert_for"),
    "plan_tasks": ("quantkit.planner.taskcost", "plan_tasks"),
    "logits": ("quantkit.validation.forward", "logits"),
    "convert": ("quantkit.conversion.pipeline", "convert"),
    "validate": ("quantkit.validation.pipeline", "validate"),
    "verify": ("quantkit.checkpoint.manifest", "verify"),
    "pull": ("quantkit.hub.download", "pull"),
    "check_serving": ("quantkit.serving.checks", "check_serving"),
    "Checkpoint": ("quantkit.checkpoint.reader", "Checkpoint"),
    "QuantkitError": ("quantkit.errors", "QuantkitError"),
    "ConvertResult": ("quantkit.conversion.report", "ConvertResult"),
    "ValidationResult": ("quantkit.validation.report", "ValidationResult"),
    "RowMetrics": ("quantkit.validation.report", "RowMetrics"),
    "VerifyResult": ("quantkit.checkpoint.manifest", "VerifyResult"),
}

__all__ = sorted(_API)


def __dir__() -> list[str]:
    """The API and the version (not the helpers this module imports)."""
    return sorted([*_API, "__version__"])


def __getattr__(name: str):
    if name in _API:
        from importlib import import_module

        module, attr = _API[name]
        return getattr(import_module(module), attr)
    raise AttributeError(f"module 'quantkit' has no attribute {name!r}")
