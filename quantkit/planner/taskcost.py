"""What `quantkit validate --tasks` costs at full scale, before anyone rents the GPUs for it.

A task run is lm-eval's requests through quantkit's streaming forward (quantkit.validation.lmmodel):
every pass over the layers reads each layer of one checkpoint, and what the device cannot keep
resident is re-read from disk on every pass. So the cost is counted in passes: a log-likelihood task
needs as many passes as its sequences take batches (`activation_bytes` each, within the activation
budget); a generation task needs max_gen_toks passes per batch of prompts (greedy, in lockstep until
the longest answer stops). `plan --tasks gsm8k,mmlu` prints it per checkpoint row; docs/evals.md
gives the arithmetic for GLM 5.2.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from quantkit.errors import ConfigError
from quantkit.runtime.units import GB, GiB

__all__ = ["PROFILES", "TaskProfile", "TaskCost", "activation_bytes", "task_cost"]

def activation_bytes(arch, T: int) -> int:
    """Float32 working memory of one sequence of T tokens in a pass: hidden states and their temporaries,
    the logits and their log-softmax, and its attention scores (heads x T x T)."""
    return 4 * T * (16 * arch.hidden_size + 3 * arch.vocab_size + 2 * arch.num_attention_heads * T)


@dataclass(frozen=True)
class TaskProfile:
    """lm-eval's default form of a task: items, shots, and the tokens a request carries (typical)."""

    items: int
    shots: int
    kind: str  # "loglikelihood" or "generate_until"
    requests_per_item: int
    prompt_tokens: int  # context with its few-shot examples, mean
    continuation_tokens: int  # scored tokens per log-likelihood request
    max_gen_toks: int  # generation: lm-eval's cap (its default 256)


# lm-eval 0.4's gsm8k (test split, 5-shot, until "Question:", max_gen_toks 256) and mmlu (57 subjects'
# test splits; 5-shot is the usual report, 4 choices of one answer token each)
PROFILES = {
    "gsm8k": TaskProfile(items=1319, shots=5, kind="generate_until", requests_per_item=1, prompt_tokens=900,
                         continuation_tokens=0, max_gen_toks=256),
    "mmlu": TaskProfile(items=14042, shots=5, kind="loglikelihood", requests_per_item=4, prompt_tokens=620,
                        continuation_tokens=1, max_gen_toks=0),
}


@dataclass
class TaskCost:
    task: str
    checkpoint: str
    passes: int  # forward passes over the layers
    sequences_per_pass: int
    tokens_processed: int  # tokens through the layers (prompts, continuations, generated)
    tokens_generated: int  # at most: every item to max_gen_toks
    checkpoint_bytes: int
    kept_bytes: int  # held in device memory after the first read
    bytes_read: int  # the first read, then what is not kept, every pass
    seconds: float  # disk reads, the kept weights' dequantization every pass, float32 matmuls
    gpus: int = 1

    def to_json(self) -> dict:
        return asdict(self)


def task_cost(arch, task: str, checkpoint: str, checkpoint_bytes: int, *, active_params: int, gpus: int, gpu_bytes: int,
              flops: float, disk: float, hbm: float, batch_bytes: int | None = None) -> TaskCost:
    """One task on one checkpoint. `gpus` x `gpu_bytes` hold the weights (what does not fit is re-read
    every pass, and the kept weights are read and written dequantized (float32) every pass, at `hbm`
    bytes/s per GPU); the activation budget is a quarter of one GPU unless `batch_bytes`; `flops` per GPU;
    `active_params` per token (quantkit.planner.capacity's params_active)."""
    if task not in PROFILES:
        raise ConfigError(f"--tasks {task}: no cost profile (known: {', '.join(PROFILES)}); the planner counts "
                          "lm-eval's default gsm8k and mmlu")
    p = PROFILES[task]
    bb = batch_bytes or gpu_bytes // 4
    T = p.prompt_tokens + max(p.continuation_tokens, p.max_gen_toks)
    per_pass = max(bb // activation_bytes(arch, T), 1)
    if p.kind == "loglikelihood":
        seqs = p.items * p.requests_per_item
        passes = math.ceil(seqs / per_pass)
        tokens, generated = seqs * T, 0
    else:
        passes = math.ceil(p.items / per_pass) * p.max_gen_toks
        tokens, generated = p.items * T, p.items * p.max_gen_toks
    kept = int(min(checkpoint_bytes, max(gpus * gpu_bytes * 0.85 - bb, 0)))
    read = checkpoint_bytes + (passes - 1) * (checkpoint_bytes - kept)
    dequant = passes * kept * 5 / (hbm * gpus)  # read as stored (~1 byte a weight), write float32
    seconds = read / disk + dequant + 2 * active_params * tokens / (flops * gpus)
    return TaskCost(task, checkpoint, passes, per_pass, tokens, generated, checkpoint_bytes, kept, read, seconds, gpus)


def render(costs: list[TaskCost]) -> str:
    lines = ["task run (validate --tasks), per checkpoint: passes over the layers, tokens, bytes read, time"]
    for c in costs:
        lines.append(f"  {c.task} on {c.checkpoint}: {c.passes:,} passes ({c.sequences_per_pass} sequences each), "
                     f"{c.tokens_processed / 1e6:.1f}M tokens, {c.tokens_generated / 1e3:.0f}k generated at most; "
                     f"{c.kept_bytes / GB:.0f} of {c.checkpoint_bytes / GB:.0f} GB kept, {c.bytes_read / 1e12:.1f} TB read; "
                     f"about {c.seconds / 3600:.1f} h")
    if costs and costs[0].gpus > 1:
        lines.append(f"  note: {costs[0].gpus} GPUs hold the weights between them, as `validate --nproc` holds its share; "
                     "`validate --tasks` itself runs in one process today, on one device")
    return "\n".join(lines)


def plan_tasks(model: str, tasks: str | list[str], *, gpus: int = 1, gpu: str = "h200", group_size: int = 128) -> list[TaskCost]:
    """`quantkit plan MODEL --tasks gsm8k,mmlu`: every task on the source, prefill and decode checkpoint
    (the sizes quantkit.planner.capacity predicts), on `gpus` GPUs of kind `gpu`."""
    from quantkit.planner.capacity import plan as size_plan
    from quantkit.planner.gpus import GPUS
    from quantkit.planner.target import resolve_target

    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    spec = GPUS.get(gpu)
    if spec is None or spec.flops is None or spec.disk is None or spec.hbm is None:
        known = ", ".join(k for k, v in GPUS.items() if v.flops and v.hbm)
        raise ConfigError(f"--gpu {gpu}: no sustained rates for a task-cost estimate (known: {known})")
    p = size_plan(model, group_size=group_size)
    arch = resolve_target(model, headers=False).arch
    return [task_cost(arch, t, row, p.checkpoints[row].total_bytes, active_params=p.params_active, gpus=gpus, gpu_bytes=int(spec.mem_gib * GiB),
                      flops=spec.flops, disk=spec.disk, hbm=spec.hbm)
            for t in names for row in ("source", "prefill", "decode")]
