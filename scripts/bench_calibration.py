#!/usr/bin/env python
"""Does calibration pay? RTN, GPTQ, AWQ, RTN-clip (data-free) and llm-compressor's GPTQ on a suite of model classes.

One table per class. Every method quantizes the routed experts from the same calibration token ids;
quality is the experts' alone: each quantkit output's INT4 experts are spliced into the float32
dequantized copy of the source that llm-compressor starts from (scripts/bench_convert.py's
`reference_copy` / `splice_experts`), so every row differs from the reference only in its experts
(the equivalent of `--decode-rest bf16`, without the BF16 rounding of an FP8 source's attention).

Quality is the per-token KL(reference || run) (quantkit.validation.metrics.token_kl) on held-out
windows from other documents than the calibration's (corpus seeds >= 2000; calibration uses
seeds < 1000), and on three off-distribution sets: other text (the other corpus: the Markov
language for the classes calibrated on the synthetic corpus, the synthetic corpus for the Markov
class), the same language with every window's word order reversed ("reversed"), and uniform random
token ids. Differences are paired: per window, the mean
per-token KL of a minus that of b, then mean and standard error over windows (the windows are the
independent units; positions inside one are correlated). `z` = difference / SE.

    python scripts/bench_calibration.py                          # every class, ~25 min on 2 cores
    python scripts/bench_calibration.py --classes tiny-glm,random-glm-fp8
    python scripts/bench_calibration.py --classes tiny-glm --no-llmc --variant damp0.1:gptq.dampening=0.1
    python scripts/bench_calibration.py --classes tiny-glm --no-llmc --base "" --variant ship:... --mix-reversed 0.25
    python scripts/bench_calibration.py --shipped glm-5.2 --base GPTQ,AWQ --llmc-rows llmc --num-samples 128 --seq-len 128
                                                                 # the acceptance grid at one calibration size
    python scripts/bench_calibration.py --summarize OUT32 OUT128 OUT512 --plot kl.png --plot-class tiny-glm
                                                                 # KL against calibration size, from those runs

--variant NAME:FIELD=VALUE[,FIELD=VALUE] adds a quantkit GPTQ run with recipe fields changed (an
experiment, docs/benchmarks.md "Tried and dropped"); METHOD=awq in the list makes it an AWQ run.

Classes (each built once, cached under $QUANTKIT_CACHE/bench-calibration):
  tiny-glm              the trained tiny GLM 5.2 (FP8 source, DSA), group 128
  tiny-kimi             the trained tiny Kimi K2.6, requantized to group 128 from its INT4 g32 experts
  trained-dsv3          transformers' DeepseekV3ForCausalLM trained 300 steps on CPU on a Markov language
                        unlike the tiny models' (calibrated and evaluated on that language)
  two-domain-dsv3       the same model trained 400 steps on two languages, the synthetic corpus and the Markov
                        one, half each (calibrated on the synthetic corpus: "other text" is its second language)
  random-dsv3-outliers  random BF16 DeepSeek-V3 layout, 1/64 of each expert Linear's input columns x4
  random-glm-fp8        random GLM-MoE-DSA weights stored FP8 (GLM-5.2-FP8's format), DSA active
  random-dsv3-wide, random-glm-wide
                        random weights at hidden 1024, 32 experts, top-8, heavy input columns
  many-experts-dsv3     trained, 128 experts, top-8, a skewed router (a hot few, a long starved tail)
  real-vocab-dsv3       trained-dsv3 with 151,552 embedding rows (GLM 5.2's vocabulary), ids < 512 trained
  realshape-glm         realshape:glm-5.2 (real width, 2 layers, 16 experts top-8) at --realshape-budgets
                        (RTN, GPTQ, AWQ; no llm-compressor; only when named in --classes)

This is a benchmark that prints tables, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_convert as bc  # noqa: E402  (scripts/ is not a package)

EVAL_SEED = 2000  # corpus seeds >= 1000 are never seen by the tiny models' training or calibration
REVERSED_SEED = 3000
RANDOM_IDS_SEED = 4000
OTHER_TEXT_SEED = 5000
MIX_REVERSED_SEED = 500  # --mix-reversed's second source: train-side corpus seeds, above what synthetic:train reaches here
MIX_OTHER_SEED = 300_000  # --mix-other's second source: Markov documents no eval set (5000 and up) or training (100000+) has


# ---- the model classes -------------------------------------------------------------------------------
def _outlier_columns(t: dict, frac: float, factor: float, seed: int) -> None:
    """Scale `frac` of each routed-expert Linear's input columns by `factor`, in place: real expert
    weights have a few heavy input columns, which set their group's INT4 scale."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for name, w in t.items():
        if ".mlp.experts." in name and name.endswith("proj.weight"):
            cols = torch.randperm(w.shape[1], generator=gen)[: max(1, int(w.shape[1] * frac))]
            w[:, cols] *= factor


def _random_dsv3(folder: Path) -> None:
    import torch

    from quantkit.checkpoint.writer import CheckpointWriter
    from quantkit.model.arch import arch_from_config
    from quantkit.synthetic.tiny import KIMI_TEXT, init_weights, tokenizer_files

    cfg = dict(KIMI_TEXT, num_hidden_layers=3, hidden_size=512, n_routed_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=256, intermediate_size=768)
    arch = arch_from_config(cfg)
    t = init_weights(arch, torch.Generator().manual_seed(0))
    _outlier_columns(t, 1 / 64, 4.0, seed=1)
    w = CheckpointWriter(folder, digits=5)
    for L in [None, *range(arch.num_layers_with_mtp)]:
        pre = None if L is None else arch.layer_prefix(L)
        for name in sorted(t):
            if (L is None and ".layers." in name) or (L is not None and not name.startswith(pre)):
                continue
            x = t.pop(name)
            w.add(name, x.float() if name.endswith("e_score_correction_bias") else x.to(torch.bfloat16))
        w.flush()
    w.finish(cfg, extra=tokenizer_files())


def _random_glm(folder: Path) -> None:
    import torch

    from quantkit.model.arch import arch_from_config
    from quantkit.synthetic.tiny import GLM, init_weights, save_glm

    cfg = dict(GLM, num_hidden_layers=3, hidden_size=256, n_routed_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=256, intermediate_size=768, num_nextn_predict_layers=0)
    arch = arch_from_config(cfg)
    save_glm(init_weights(arch, torch.Generator().manual_seed(0)), arch, cfg, folder)


def _random_dsv3_wide(folder: Path) -> None:
    """DeepSeek-V3 layout at a wider hidden size (1024), 32 experts, top-8, heavy input columns: about
    half a routed token per input column at 32 x 64 calibration tokens."""
    import torch

    from quantkit.checkpoint.writer import CheckpointWriter
    from quantkit.model.arch import arch_from_config
    from quantkit.synthetic.tiny import KIMI_TEXT, init_weights, tokenizer_files

    cfg = dict(KIMI_TEXT, num_hidden_layers=3, hidden_size=1024, n_routed_experts=32, num_experts_per_tok=8,
               moe_intermediate_size=256, intermediate_size=1024)
    arch = arch_from_config(cfg)
    t = init_weights(arch, torch.Generator().manual_seed(0))
    _outlier_columns(t, 1 / 64, 4.0, seed=1)
    w = CheckpointWriter(folder, digits=5)
    for L in [None, *range(arch.num_layers_with_mtp)]:
        pre = None if L is None else arch.layer_prefix(L)
        for name in sorted(t):
            if (L is None and ".layers." in name) or (L is not None and not name.startswith(pre)):
                continue
            x = t.pop(name)
            w.add(name, x.float() if name.endswith("e_score_correction_bias") else x.to(torch.bfloat16))
        w.flush()
    w.finish(cfg, extra=tokenizer_files())


def _random_glm_wide(folder: Path) -> None:
    """GLM 5.2 layout, FP8 source, hidden 1024, 32 experts, top-8, heavy input columns."""
    import torch

    from quantkit.model.arch import arch_from_config
    from quantkit.synthetic.tiny import GLM, init_weights, save_glm

    cfg = dict(GLM, num_hidden_layers=3, hidden_size=1024, n_routed_experts=32, num_experts_per_tok=8,
               moe_intermediate_size=256, intermediate_size=1024, num_nextn_predict_layers=0)
    arch = arch_from_config(cfg)
    t = init_weights(arch, torch.Generator().manual_seed(0))
    _outlier_columns(t, 1 / 64, 4.0, seed=2)
    save_glm(t, arch, cfg, folder)


def _many_experts_dsv3(folder: Path, steps: int = 150) -> None:
    """DeepSeek-V3 with 128 routed experts, top-8, trained briefly on the Markov language (so routing
    carries structure), then a skewed router: each expert's selection bias (e_score_correction_bias,
    which picks experts but does not weight them) set from a Zipf-like profile, so a hot few take most
    tokens and a long tail sees under one routed token per input column at 32 x 256."""
    import torch
    from safetensors.torch import load_file, save_file

    _train_dsv3(folder, markov_windows(16 * steps, 64, 100_000), steps, n_routed_experts=128, num_experts_per_tok=8)
    rank = torch.randperm(128, generator=torch.Generator().manual_seed(7)).float()  # expert -> popularity rank
    bias = -0.02 * torch.log1p(rank)  # sigmoid scores are ~0.5 +- 0.05: a log-rank bias skews without silencing
    for f in sorted(folder.glob("*.safetensors")):
        t = load_file(f)
        for k in [k for k in t if k.endswith("e_score_correction_bias")]:
            t[k] = bias.to(t[k].dtype)
        save_file(t, f, metadata={"format": "pt"})


def markov_windows(n: int, seq: int, seed: int, vocab: int = 512):
    """(n, seq) windows of a language unlike the tiny models': an order-1 Markov chain over ids
    [6, vocab) whose fixed transition table (4 successors per token, skewed probabilities) is the
    grammar; each window is a document (BOS, then the chain from a random start), `seed` + i its seed."""
    import torch

    g = torch.Generator().manual_seed(12345)
    succ = torch.randint(6, vocab, (vocab, 4), generator=g)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    out = torch.empty(n, seq, dtype=torch.int64)
    for i in range(n):
        d = torch.Generator().manual_seed(seed + i)
        out[i, 0], tok = 1, int(torch.randint(6, vocab, (1,), generator=d))
        for j in range(1, seq):
            out[i, j] = tok
            tok = int(succ[tok, torch.multinomial(probs, 1, generator=d)])
    return out


def _train_dsv3(folder: Path, data, steps: int, n_routed_experts: int = 16, num_experts_per_tok: int = 4,
                vocab_size: int = 512) -> None:
    """transformers' own DeepseekV3ForCausalLM, trained on CPU on `data` ((16 * steps, 64) ids, 16 a step),
    saved by save_pretrained (per-expert tensors, BF16)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from quantkit.synthetic.tiny import tokenizer_files

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, moe_intermediate_size=128,
                           num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok, n_shared_experts=1,
                           n_group=1, topk_group=1,
                           q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                           routed_scaling_factor=2.5, norm_topk_prob=True, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0, tie_word_embeddings=False, num_nextn_predict_layers=0)
    model = DeepseekV3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        ids = data[16 * step: 16 * (step + 1)]
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.to(torch.bfloat16).save_pretrained(folder)
    for name, text in tokenizer_files().items():
        (folder / name).write_text(text)
    (folder / "train-loss.txt").write_text(f"{loss.item():.4f} after {steps} steps\n")


def _trained_dsv3(folder: Path, steps: int = 300) -> None:
    """DeepSeek-V3 trained on the Markov language alone (a couple of minutes)."""
    _train_dsv3(folder, markov_windows(16 * steps, 64, 100_000), steps)  # training documents: seeds 100000 and up


def _real_vocab_dsv3(folder: Path, steps: int = 300) -> None:
    """trained-dsv3 with GLM 5.2's vocabulary size (151,552 embedding rows): the Markov language uses ids
    below 512, so the other 99.7% of rows stay as initialized, as a real model's rarely seen tokens are
    barely trained. The random share (uniform over every row) then feeds mostly such rows."""
    _train_dsv3(folder, markov_windows(16 * steps, 64, 100_000), steps, vocab_size=151_552)


def _two_domain_dsv3(folder: Path, steps: int = 400) -> None:
    """DeepSeek-V3 trained on two languages, the way a real model is trained on chat and code: every
    step's 16 windows are 8 of the synthetic corpus (seeds 0-399, the calibration's side) and 8 of the
    Markov language (seeds 100000 and up). The languages share ids 6-130 and the Markov one also uses
    the ids above, so the router can tell them apart: experts that one language sends most of its
    tokens to are what a one-language calibration leaves thin."""
    import torch

    from quantkit.synthetic.tiny import batches

    syn = torch.cat([batches(8, 64, seed) for seed in range(steps)])  # (8 * steps, 64)
    mk = markov_windows(8 * steps, 64, 100_000)
    data = torch.stack([syn.view(steps, 8, 64), mk.view(steps, 8, 64)], 1).reshape(16 * steps, 64)  # 8 + 8 a step
    _train_dsv3(folder, data, steps)


CLASSES = {
    # name: (build into a folder, or a tiny spec; group size; calibration windows x length; corpus)
    "tiny-glm": ("tiny:glm-5.2", 128, (64, 64), "synthetic"),
    "tiny-kimi": ("tiny:kimi-k2.6", 128, (64, 64), "synthetic"),
    "trained-dsv3": (_trained_dsv3, 128, (64, 64), "markov"),
    "two-domain-dsv3": (_two_domain_dsv3, 128, (64, 64), "synthetic"),
    "random-dsv3-outliers": (_random_dsv3, 128, (32, 128), "synthetic"),
    "random-glm-fp8": (_random_glm, 128, (32, 64), "synthetic"),
    "random-dsv3-wide": (_random_dsv3_wide, 128, (32, 64), "synthetic"),
    "random-glm-wide": (_random_glm_wide, 128, (32, 64), "synthetic"),
    "many-experts-dsv3": (_many_experts_dsv3, 128, (32, 256), "markov"),
    "real-vocab-dsv3": (_real_vocab_dsv3, 128, (64, 64), "markov"),
}
# Chosen before any setting was tuned (docs/benchmarks.md, "Tuning and confirmation"): settings are
# chosen on TUNING alone; CONFIRMATION runs once per candidate and decides whether it ships.
TUNING = ("tiny-glm", "trained-dsv3", "random-dsv3-outliers", "random-dsv3-wide")
CONFIRMATION = ("tiny-kimi", "two-domain-dsv3", "random-glm-fp8", "random-glm-wide", "many-experts-dsv3",
                "real-vocab-dsv3")  # added after the split, with no setting tuned since: confirmation


def class_source(name: str) -> Path:
    """The class's source checkpoint folder, built once (keyed by its builder's source text)."""
    import inspect

    from quantkit.inputs.modelspec import resolve
    from quantkit.runtime.files import cache_dir
    from quantkit.synthetic.tiny import cached_build

    build = CLASSES[name][0]
    if isinstance(build, str):
        return Path(resolve(build))
    text = inspect.getsource(build) + inspect.getsource(markov_windows) + inspect.getsource(_outlier_columns)
    if name.endswith("dsv3") and name != "random-dsv3-wide":
        text += inspect.getsource(_train_dsv3)
    key = hashlib.sha256(text.encode()).hexdigest()[:10]
    return cached_build(cache_dir() / "bench-calibration" / f"{name}-{key}", build)


def eval_sets(n: int, seq: int, vocab: int, corpus: str = "synthetic") -> dict:
    """Held-out windows: the calibration's language from other documents, and three other kinds:
    other text (the other corpus: the Markov language for a class calibrated on the synthetic
    corpus, the synthetic corpus for the Markov class; a language with its own grammar and its own
    token frequencies, the way code or a second language differs from chat), the calibration's
    language reversed, and uniform random ids."""
    import torch

    from quantkit.synthetic.tiny import batches

    make, other = (batches, markov_windows) if corpus == "synthetic" else (markov_windows, batches)
    rev = make(n // 2, seq, REVERSED_SEED).flip(-1)
    rand = torch.randint(0, vocab, (n // 2, seq), generator=torch.Generator().manual_seed(RANDOM_IDS_SEED))
    txt = other(n // 2, seq, OTHER_TEXT_SEED)
    if int(txt.max()) >= vocab:
        raise RuntimeError(f"other-text ids reach {int(txt.max())}, beyond the class's vocabulary of {vocab}")
    return {"in-dist": make(n, seq, EVAL_SEED), "other-text": txt, "reversed": rev, "random-ids": rand}


SHIPPED_GPTQ = ("dampening", "actorder", "observer", "static_groups", "hessian_weighting", "holdout", "min_tokens",
                "fallback", "width_prior", "prior_tokens", "low_dampening", "shrinkage")


def shipped_fields(recipe: str) -> dict:
    """--shipped: the named real recipe's gptq section as variant_recipe fields (dotted name -> YAML
    text), so the GPTQ and AWQ rows run the settings a user of that recipe gets, on the class's own
    group size and calibration."""
    from quantkit.recipe import load_recipe

    g = load_recipe(recipe).gptq
    return {f"gptq.{k}": json.dumps(getattr(g, k)) for k in SHIPPED_GPTQ}


# ---- runs --------------------------------------------------------------------------------------------
def variant_recipe(base: str, fields: dict, path: Path) -> Path:
    """A recipe file: `base` (a recipe name) with dotted `fields` replaced."""
    import yaml

    from quantkit.recipe import load_recipe

    data = load_recipe(base).model_dump(mode="json")
    for dotted, value in fields.items():
        *parents, leaf = dotted.split(".")
        d = data
        for p in parents:
            d = d[p]
        d[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(data))
    load_recipe(path)  # fails here, naming the field, rather than inside the measured run
    return path


def quantkit_run(src: Path, out: Path, method: str, calib: tuple[int, int], G: int, recipe: Path | str, logs: Path,
                 env: dict, data: str = "synthetic:train", rest: str = "bf16") -> dict:
    cmd = [sys.executable, "-m", "quantkit.cli", "convert", str(src), "--out", str(out), "--method", method,
           "--recipe", str(recipe), *(["--calib", data] if data else []), "--num-samples", str(calib[0]),
           "--seq-len", str(calib[1]), "--group-size", str(G), "--decode-rest", rest, "--device", "cpu",
           "--no-validate", "--json"]
    m = bc.measured(cmd, logs / f"{out.name}.log", env=env)
    report = json.loads((logs / f"{out.name}.log").read_text())
    m["experts"] = report["experts"]
    m["sha256"] = (report["calibration"] or {}).get("sha256")
    m["planned_peak_bytes"] = report["cost"]["peak_host"]  # what convert's planner predicted for this run
    return m


def mix_second_source(calib: tuple[int, int], wd: Path, kind: str = "reversed") -> str:
    """A mix's second source: a token file from documents no eval set uses (--mix-reversed's, the same
    language reversed, MIX_REVERSED_SEED and up, where the reversed eval set is REVERSED_SEED's;
    --mix-other's, the other corpus, the Markov language, MIX_OTHER_SEED and up, where the other-text eval
    set is OTHER_TEXT_SEED's), or --mix-random's, quantkit's own `random` spec (the real recipes' share)."""
    import numpy as np

    from quantkit.synthetic.tiny import batches

    if kind == "random":
        return "random"
    second = wd / f"calib-{kind}.npy"
    ids = batches(calib[0], calib[1], MIX_REVERSED_SEED).flip(-1) if kind == "reversed" else \
        markov_windows(calib[0], calib[1], MIX_OTHER_SEED)
    np.save(second, ids.numpy())
    return str(second)


def mix_recipe(recipe: str | Path, second: str, share: float, path: Path, first: str = "synthetic:train") -> Path:
    """A recipe file: `recipe` (a name or file) calibrated on a mix at the same total windows:
    (1 - share) of them `first` (the class's calibration data), `share` from `second`."""
    import yaml

    from quantkit.recipe import load_recipe

    data = load_recipe(recipe).model_dump(mode="json")
    data["calibration"].update(dataset=None, mix=[{"data": first, "weight": 1 - share},
                                                  {"data": second, "weight": share}])
    path.write_text(yaml.safe_dump(data))
    load_recipe(path)
    return path


def guard_summary(experts: list[dict]) -> dict:
    """The guard's verdict: on how many calibrated experts the calibrated weights beat RTN on the
    held-out tokens, and how many are stored calibrated (the rest RTN)."""
    judged = [e for e in experts if e.get("err") is not None and e.get("err_rtn") is not None]
    better = sum(1 for e in judged if e["err"] < e["err_rtn"])
    from quantkit.quant.methods import METHODS

    stored = sum(1 for e in experts if e["method"] in METHODS and METHODS[e["method"]].calibrated)
    rel = [(e["err"] - e["err_rtn"]) / e["err_rtn"] for e in judged if e["err_rtn"] > 0]
    tokens = sorted(e["tokens"] for e in experts if e.get("tokens") is not None)
    return {"judged": len(judged), "calibrated_better": better, "stored_calibrated": stored, "total": len(experts),
            "mean_rel_err_vs_rtn": sum(rel) / len(rel) if rel else None,
            "starved": sum(1 for e in experts if e.get("fallback")),
            "tokens_min": tokens[0] if tokens else None, "tokens_median": tokens[len(tokens) // 2] if tokens else None}


def window_kl(ref_lp, lp):
    """Mean per-token KL(ref || run) of each window, (N,) float64."""
    from quantkit.validation.metrics import token_kl

    return token_kl(ref_lp, lp).mean(-1)


def windows_kl(ref: Path, folders: dict, ids, chunk: int = 16) -> dict:
    """{row: (N,) per-window KL(ref || row)} on ids (N, T), `chunk` windows at a time: the log-probs of
    one chunk per checkpoint are all that is held (at a real vocabulary, 151,552 ids, a whole set's
    would be 5 GB a checkpoint). Per-window values are the same however the windows are chunked."""
    import torch

    parts: dict = {k: [] for k in folders}
    for i in range(0, len(ids), chunk):
        ref_lp = bc.log_probs(ref, ids[i:i + chunk], chunk)
        for k, f in folders.items():
            parts[k].append(window_kl(ref_lp, bc.log_probs(f, ids[i:i + chunk], chunk)))
        del ref_lp
    return {k: torch.cat(v) for k, v in parts.items()}


def run_plan(args, base: str, wd: Path, calib: tuple[int, int], data: str, corpus: str, name: str):
    """The class's quantkit runs as (row name, method, recipe): RTN, the --base rows (with --shipped's
    settings), the --variant rows, and with a --mix-* option each calibrated row's mix form beside it
    (or instead of it, --mix-only); and a mix row's (windows, tokens per window)."""
    plan = [(k, m, base) for k, m in (("RTN", "rtn"), ("GPTQ", "gptq"), ("AWQ", "awq"), ("RTN-clip", "rtn-clip"))
            if k == "RTN" or k in args.base.split(",")]
    if args.shipped:  # the calibrated rows with a shipped real recipe's settings
        fields = shipped_fields(args.shipped)
        plan = [(k, m, variant_recipe(base, fields, wd / f"{k}-{args.shipped}.yaml") if m in ("gptq", "awq") else r)
                for k, m, r in plan]
    for spec in args.variant:
        vname, _, fields = spec.partition(":")
        kv = dict(f.split("=", 1) for f in fields.split(",") if f)
        if args.shipped:  # the variant changes the shipped settings, not the tiny recipe's
            kv = {**shipped_fields(args.shipped), **kv}
        method = kv.pop("METHOD", "gptq")
        plan.append((vname, method, variant_recipe(base, kv, wd / f"{vname}.yaml")))
    share, kind = next(((v, k) for k, v in (("reversed", args.mix_reversed), ("other", args.mix_other),
                                              ("random", args.mix_random)) if v), (0.0, ""))
    extra = 0
    if share:
        if corpus != "synthetic" and kind != "random":
            raise RuntimeError(f"{name}: --mix-{kind} needs a class calibrated on the synthetic corpus")
        second = mix_second_source(calib, wd, kind)
        if args.mix_extra:  # the second source's windows on top of the class's: share of (N + extra)
            extra = round(calib[0] * share)
            share = extra / (calib[0] + extra)
        plan += [(f"{k} mix", m, mix_recipe(r, second, share, wd / f"{k}-mix.yaml", data))
                 for k, m, r in list(plan) if k != "RTN"]
        if args.mix_only:  # the calibrated rows in their mix form only (RTN stays: every z is against it)
            plan = [p for p in plan if p[0] == "RTN" or p[0].endswith(" mix")]
    mixed = (calib[0] + extra, calib[1])  # a mix run's windows
    return plan, mixed


def run_class(name: str, args, work: Path, env: dict, say) -> dict:
    import torch

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.inputs.tokens import load_tokens
    from quantkit.recipe import load_recipe, recipe_overrides
    from quantkit.validation.metrics import paired

    src = class_source(name)
    _, G, calib, corpus = CLASSES[name]
    calib = (args.num_samples or calib[0], args.seq_len or calib[1])
    ck = Checkpoint(src)
    arch = ck.arch
    base = {"glm": "tiny-glm-5.2", "kimi": "tiny-kimi-k2.6"}.get(arch.family, "tiny-glm-5.2")
    rec = recipe_overrides(load_recipe(base), group_size=G, num_samples=calib[0], seq_len=calib[1],
                           calib="synthetic:train")
    wd = work / name
    logs = wd / "logs"
    wd.mkdir(parents=True)
    data = "synthetic:train"
    if corpus == "markov":  # calibration documents: seeds 0 and up (training: 100000 and up; held out: 2000 and up)
        import numpy as np

        data = str(wd / "calib.npy")
        np.save(data, markov_windows(*calib, 0).numpy())
    runs: dict = {}
    plan, mixed = run_plan(args, base, wd, calib, data, corpus, name)
    for key, method, recipe in plan:
        say(f"{name}: quantkit {key} ...")
        mix_run = key.endswith(" mix")
        runs[key] = quantkit_run(src, wd / key.replace(" ", "-"), method, mixed if mix_run else calib, G, recipe, logs,
                                 env, None if mix_run else data)
    tokens = load_tokens(data, tokenizer=src, num_samples=calib[0], seq_len=calib[1],
                         seed=rec.calibration.seed)
    if any(m["sha256"] not in (None, tokens.sha256) for k, m in runs.items() if not k.endswith(" mix")):
        raise RuntimeError(f"{name}: calibration ids differ between quantkit and llm-compressor")
    ref = bc.reference_copy(src, wd / "ref", "float32")
    reused: dict = {}
    if args.llmc_from:  # llm-compressor's outputs of an earlier run on the same calibration ids
        old = json.loads((args.llmc_from / "results.json").read_text())
        old = next((r for r in old if r["class"] == name), None)
        if old is None or old.get("llmc_actorder") != ("static" if rec.gptq.actorder or args.llmc_actorder == "static"
                                                        else "none"):
            raise RuntimeError(f"{name}: no llm-compressor run with this act-order in {args.llmc_from}")
        for key in [k for k in ("llmc", "llmc-routed") if k in old["rows"] and k in args.llmc_rows.split(",")]:
            reused[key] = args.llmc_from / name / key
            runs[key] = {k: old["rows"][key][k] for k in ("wall_s", "cpu_s", "peak_rss_bytes")}
        if not torch.equal(torch.load(args.llmc_from / name / "calib-ids.pt"), tokens.ids):
            raise RuntimeError(f"{name}: {args.llmc_from}'s llm-compressor runs used other calibration ids")
    elif not args.no_llmc:
        torch.save(tokens.ids, wd / "calib-ids.pt")
        for key, all_experts in [(k, a) for k, a in (("llmc", True), ("llmc-routed", False))
                                 if k in args.llmc_rows.split(",")]:
            say(f"{name}: llm-compressor {key} ...")
            spec = {"model": str(ref), "out": str(wd / key), "ids": str(wd / "calib-ids.pt"), "group_size": G,
                    "block_size": rec.gptq.block_size, "dampening": rec.gptq.dampening,
                    "actorder": rec.gptq.actorder or args.llmc_actorder == "static",
                    "dtype": "float32", "all_experts": all_experts}
            runs[key] = bc.measured([sys.executable, str(Path(bc.__file__)), "_llmc", json.dumps(spec)],
                                    logs / f"{key}.log", env=env)
    say(f"{name}: quality ...")
    sets = eval_sets(args.eval_samples, args.eval_seq_len, arch.vocab_size, corpus)
    folders = {k: (reused.get(k, wd / k) if k.startswith("llmc") else bc.splice_experts(
                   ref, wd / k.replace(" ", "-") / "decode", wd / f"{k.replace(' ', '-')}-spliced")) for k in runs}
    kl = {s: windows_kl(ref, folders, ids) for s, ids in sets.items()}
    table = {}
    for k, m in runs.items():
        row = {"wall_s": m["wall_s"], "cpu_s": m["cpu_s"], "peak_rss_bytes": m["peak_rss_bytes"],
               **({"planned_peak_bytes": m["planned_peak_bytes"]} if "planned_peak_bytes" in m else {})}
        for s in sets:
            w = kl[s][k]  # per-window mean KL: the windows are the independent units
            row[s] = {"kl": w.mean().item(), "kl_se": (w.std() / len(w) ** 0.5).item() if len(w) > 1 else None,
                      "vs_rtn": vars(paired(w, kl[s]["RTN"]))}
            if "llmc" in kl[s]:
                row[s]["vs_llmc"] = vars(paired(kl[s][k], kl[s]["llmc"]))
            if k.endswith(" mix") and k[: -len(" mix")] in kl[s]:  # the same method on one source, same tokens
                row[s]["vs_unmixed"] = vars(paired(kl[s][k], kl[s][k[: -len(" mix")]]))
        if "experts" in m:
            row["guard"] = guard_summary(m["experts"])
        table[k] = row
    return {"class": name, "source": str(src), "model_type": arch.model_type, "group_size": G,
            "llmc_actorder": "static" if rec.gptq.actorder or args.llmc_actorder == "static" else "none",
            "calibration": f"{'synthetic:train' if corpus == 'synthetic' else 'markov'} {calib[0]}x{calib[1]}",
            "settings": f"GPTQ/AWQ with {args.shipped}'s gptq settings" if args.shipped else f"{base}'s settings",
            "eval": {s: list(ids.shape) for s, ids in sets.items()}, "rows": table}


REALSHAPE = {"realshape-glm": ("realshape:glm-5.2", "glm-5.2", 128)}  # name: (spec, base recipe, group size)


def passthrough_differences(src: Path, decode: Path) -> list[str]:
    """Names of the decode checkpoint's tensors other than the routed experts whose values differ from
    the source's (float32): empty when the decode differs from the source only in its experts."""
    import torch

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.model.tensors import TensorClass

    a, b = Checkpoint(src), Checkpoint(decode)
    bad = []
    for n in b.names():
        if b.tensors[n].info.klass == TensorClass.ROUTED_EXPERT:
            continue
        if n not in a.tensors or not torch.equal(a.get(n, torch.float32), b.get(n, torch.float32)):
            bad.append(n)
    return bad


def last_layer_log_probs(ckpts: dict, ids) -> dict:
    """Log-probs (N, T, V) of every checkpoint in `ckpts` (the first is the source) on ids (N, T), when
    they differ only in the routed experts of the last decoder layer (realshape: layer 0 dense,
    layer 1 MoE): the layers before it run once, from the source; the last layer and the head run
    per checkpoint, on the same hidden states (quantkit's streamed forward, layer by layer)."""
    import copy

    import torch

    from quantkit.model.reference import Context
    from quantkit.validation.forward import embed, head
    from quantkit.validation.layerstream import streamed_layer

    src = next(iter(ckpts.values()))
    a = src.arch
    with torch.no_grad():
        ctx = Context.build(a, ids.shape[1], "cpu", torch.float32)
        h = embed(src, ids, "cpu", torch.float32)
        for layer in range(a.num_hidden_layers - 1):
            h = streamed_layer(src, layer, [h], [ctx], "cpu", torch.float32)[0]
        last = a.num_hidden_layers - 1
        return {k: head(ck, streamed_layer(ck, last, [h], [copy.copy(ctx)], "cpu", torch.float32)[0],
                        torch.float32).log_softmax(-1) for k, ck in ckpts.items()}


def run_realshape(name: str, args, work: Path, env: dict, say) -> dict:
    """A real-width class: realshape:glm-5.2 (2 decoder layers, hidden 6144, 16 routed experts top-8,
    2048 wide), RTN and GPTQ/AWQ at each calibration budget of --realshape-budgets, with the shipped
    glm-5.2 recipe's GPTQ settings. No float32 reference copy (4 GB a copy at this width): GLM's
    decode output with `decode.rest: prefill` keeps the source's own FP8 bytes for everything but
    the routed experts (checked, tensor by tensor, on the RTN output), so each decode folder differs
    from the source only in its experts, and quality is KL(source || decode) from quantkit's streamed
    forward, every checkpoint in lockstep. No llm-compressor row: its float32 copy and per-Linear
    Hessians (gate and up each their own 6144^2) do not fit this 2-core, 23 GB machine's budget."""
    import torch

    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.inputs.modelspec import resolve
    from quantkit.validation.metrics import paired

    spec, base, G = REALSHAPE[name]
    src = Path(resolve(spec))
    arch = Checkpoint(src).arch
    budgets = [tuple(int(v) for v in b.split("x")) for b in args.realshape_budgets.split(",")]
    wd = work / name
    logs = wd / "logs"
    wd.mkdir(parents=True, exist_ok=args.resume)
    plan = [("RTN", "rtn", base, budgets[0])]
    for b in budgets:
        tag = f"{b[0]}x{b[1]}"
        plan += [(f"{m.upper()} {tag}", m, base, b) for m in args.realshape_methods.split(",") if m]
        for v in args.variant:
            vname, _, fields = v.partition(":")
            kv = dict(f.split("=", 1) for f in fields.split(",") if f)
            method = kv.pop("METHOD", "gptq")
            plan.append((f"{vname} {tag}", method, variant_recipe(base, kv, wd / f"{vname}.yaml"), b))
    runs: dict = {}
    for key, method, recipe, b in plan:
        out = wd / key.replace(" ", "-")
        done = logs / f"{out.name}.rusage.json"
        if args.resume and done.is_file() and (out / "decode").is_dir():  # a finished conversion of an earlier run
            say(f"{name}: quantkit {key}: reused from {out}")
            runs[key] = json.loads(done.read_text())
            report = json.loads((logs / f"{out.name}.log").read_text())
            runs[key].update(experts=report["experts"], sha256=(report["calibration"] or {}).get("sha256"),
                             planned_peak_bytes=report["cost"]["peak_host"])
        else:
            say(f"{name}: quantkit {key} ...")
            if out.exists():
                shutil.rmtree(out)
            runs[key] = quantkit_run(src, out, method, b, G, recipe, logs, env, rest="prefill")
        runs[key]["calibration"] = f"{b[0]}x{b[1]}" if method != "rtn" else None
    bad = passthrough_differences(src, wd / "RTN" / "decode")
    if bad:
        raise RuntimeError(f"{name}: the decode output differs from the source outside the experts: {bad[:5]}")
    say(f"{name}: quality ...")
    sets = eval_sets(args.eval_samples, args.eval_seq_len, arch.vocab_size)
    ids = torch.cat(list(sets.values()))
    ckpts = {"source": Checkpoint(src), **{k: Checkpoint(wd / k.replace(" ", "-") / "decode") for k in runs}}
    lp = last_layer_log_probs(ckpts, ids)
    kl, at = {s: {} for s in sets}, 0
    for s, x in sets.items():
        for k in runs:
            kl[s][k] = window_kl(lp["source"][at:at + len(x)], lp[k][at:at + len(x)])
        at += len(x)
    table = {}
    for k, m in runs.items():
        row = {"wall_s": m["wall_s"], "cpu_s": m["cpu_s"], "peak_rss_bytes": m["peak_rss_bytes"],
               "calibration": m["calibration"], **({"planned_peak_bytes": m["planned_peak_bytes"]} if "planned_peak_bytes" in m else {})}
        for s in sets:
            w = kl[s][k]  # per-window mean KL: the windows are the independent units
            row[s] = {"kl": w.mean().item(), "kl_se": (w.std() / len(w) ** 0.5).item() if len(w) > 1 else None,
                      "vs_rtn": vars(paired(w, kl[s]["RTN"]))}
        row["guard"] = guard_summary(m["experts"])
        table[k] = row
    return {"class": name, "source": str(src), "model_type": arch.model_type, "group_size": G,
            "calibration": "synthetic:train " + ", ".join(f"{b[0]}x{b[1]}" for b in budgets) + f" (recipe {base})",
            "eval": {s: list(x.shape) for s, x in sets.items()}, "rows": table}


# ---- table -------------------------------------------------------------------------------------------
def _z(p: dict) -> float:
    return p["mean"] / p["se"] if p["se"] and p["se"] != float("inf") else 0.0


def _d(p: dict | None) -> str:
    if not p:
        return ""
    z = _z(p)
    return f"{p['mean']:+.2e}±{p['se']:.1e} ({z:+.1f})"


def acceptance(rows: dict, sets: list[str]) -> list[str]:
    """The quality bar for each calibrated row (GPTQ, AWQ): no worse than RTN beyond 1 SE on every
    input set (z <= +1), better than RTN by 2 SE in distribution (z <= -2), and within 1 SE of
    llm-compressor's default in distribution (z <= +1; lower is better); every quantkit row but RTN's."""
    out = []
    for k in [k for k in rows if k not in ("RTN", "RTN-clip") and not k.startswith("llmc")]:
        r = rows[k]
        z = {s: _z(r[s]["vs_rtn"]) for s in sets}
        worst = max(sets, key=lambda s: z[s])
        parts = [f"in-dist vs RTN {z[sets[0]]:+.1f} ({'met' if z[sets[0]] <= -2 else 'NOT met'})",
                 f"worst set vs RTN {worst} {z[worst]:+.1f} ({'met' if z[worst] <= 1 else 'NOT met'})"]
        if "vs_llmc" in r[sets[0]]:
            zl = _z(r[sets[0]]["vs_llmc"])
            parts.append(f"vs llmc {zl:+.1f} ({'met' if zl <= 1 else 'NOT met'})")
        out.append(f"acceptance {k}: " + ", ".join(parts))
    return out


def summarize(folders: list[Path], pair: tuple[str, str] = ("GPTQ", "AWQ")) -> str:
    """One markdown row per class and calibration size from earlier runs' results.json (--out
    folders): the acceptance z values of the `pair` rows (GPTQ and AWQ, or --summarize-rows', e.g. their
    mix rows: in-dist vs RTN, the worst of the other sets vs RTN, in-dist vs llmc), llm-compressor's
    worst set vs RTN, the wall ratio and the peak RSS of each run (MiB)."""
    g, a = pair
    runs = [(folder, r) for folder in folders for r in json.loads((folder / "results.json").read_text())]
    probed = any(_probe_counts(f, r["class"], k) for f, r in runs for k in pair)
    lines = [f"| class | calibration | {g}: in-dist / worst other set / vs llmc | {a}: in-dist / worst other set / vs llmc "
             f"| llmc: worst other set vs RTN | {g} wall / llmc | peak RSS MiB {g} / {a} / llmc | peak / planned {g} / {a} |"
             + (f" probe, {g} / {a}: low admitted / judged, stored low |" if probed else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if probed else "")]
    for folder, r in runs:
        if True:
            rows, sets = r["rows"], list(r["eval"])
            cells = []
            for k in pair:
                z = {s: _z(rows[k][s]["vs_rtn"]) for s in sets}
                worst = max(sets[1:], key=z.get)
                llmc = f" / {_z(rows[k][sets[0]]['vs_llmc']):+.1f}" if "vs_llmc" in rows[k][sets[0]] else ""
                cells.append(f"{z[sets[0]]:+.1f} / {worst} {z[worst]:+.1f}{llmc}")
            lm = rows.get("llmc")
            zl = {s: _z(lm[s]["vs_rtn"]) for s in sets[1:]} if lm else {}
            wl = max(zl, key=zl.get) if zl else None
            rss = " / ".join(f"{rows[k]['peak_rss_bytes'] / 2**20:.0f}" for k in (*pair, "llmc") if k in rows)
            planned = " / ".join(f"{rows[k]['peak_rss_bytes'] / rows[k]['planned_peak_bytes']:.2f}"
                                 if rows[k].get("planned_peak_bytes") else "-" for k in pair if k in rows)
            probe = " / ".join(_probe_counts(folder, r["class"], k) or "-" for k in pair)
            lines.append(f"| {r['class']} | {r['calibration'].split()[-1]} | {cells[0]} | {cells[1]} | "
                         + (f"{wl} {zl[wl]:+.1f} | {rows[g]['wall_s'] / lm['wall_s']:.2f}" if lm else " | ")
                         + f" | {rss} | {planned} |" + (f" {probe} |" if probed else ""))
    return "\n".join(lines)


def calibration_curves(results: list[dict], cls: str, rows: tuple[str, ...] = ("RTN", "GPTQ mix", "GPTQ", "llmc")) -> dict:
    """The calibration figure's data for class `cls`, from results.json entries of runs at several
    calibration sizes: {set: {row: {"tokens": [...], "kl": [...], "se": [...]}}}, sorted by tokens.
    `tokens` is the class's calibration (windows x length, the ids llm-compressor gets; a mix row adds
    its random windows on top). A row without an SE (a results.json from before it was recorded)
    gets None there."""
    out: dict = {}
    for r in sorted((r for r in results if r["class"] == cls), key=lambda r: _tokens(r["calibration"])):
        for s in r["eval"]:
            for k in rows:
                if k not in r["rows"]:
                    continue
                c = out.setdefault(s, {}).setdefault(k, {"tokens": [], "kl": [], "se": []})
                c["tokens"].append(_tokens(r["calibration"]))
                c["kl"].append(r["rows"][k][s]["kl"])
                c["se"].append(r["rows"][k][s].get("kl_se"))
    return out


def _tokens(calibration: str) -> int:
    n, length = calibration.split()[-1].split("x")
    return int(n) * int(length)


PLOT_LABELS = {"RTN": "RTN (no calibration)", "GPTQ mix": "quantkit GPTQ, shipped settings", "GPTQ": "quantkit GPTQ",
               "llmc": "llm-compressor GPTQ (its default)"}


def plot_calibration(results: list[dict], cls: str, path: Path) -> dict:
    """KL against calibration size, one panel per held-out set, RTN / quantkit / llm-compressor with
    +-1 SE bars (over windows); returns the plotted data (calibration_curves')."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    curves = calibration_curves(results, cls)
    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * max(len(curves), 1), 4), squeeze=False,
                             constrained_layout=True)
    for ax, (s, rows) in zip(axes[0], curves.items(), strict=True):
        for k, c in rows.items():
            se = [0.0 if v is None else v for v in c["se"]]
            ax.errorbar(c["tokens"], c["kl"], yerr=se, marker="o", capsize=3, lw=1.5, label=PLOT_LABELS.get(k, k))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"held out: {s}", fontsize=10)
        ax.set_xlabel("calibration tokens")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("KL(source || quantized), nats/token")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{cls}: routed experts' KL against calibration size (error bars: 1 SE over windows)", fontsize=11)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return curves


def _probe_counts(folder: Path, cls: str, run: str) -> str | None:
    """gptq.low_dampening's verdicts in a run's convert report (its log): the experts whose low
    dampening the probe admitted / judged, and those stored at it; None without a probe."""
    log = folder / cls / "logs" / f"{run.replace(' ', '-')}.log"
    if not log.is_file():
        return None
    s = json.loads(log.read_text()).get("experts_summary", {})
    return f"{s['probe_admitted_low']}/{s['probe_judged']}, {s['low_dampening']}" if s.get("probe_judged") else None


def render(res: dict) -> str:
    rows = res["rows"]
    sets = list(res["eval"])
    lines = [f"class {res['class']} ({res['model_type']}); calibration {res['calibration']}; INT4 g{res['group_size']}; "
             f"held-out " + ", ".join(f"{s} {'x'.join(map(str, v))}" for s, v in res["eval"].items())
             + (f"; llmc actorder {res['llmc_actorder']}" if "llmc" in rows else "")
             + (f"; {res['settings']}" if "settings" in res else "")]
    hdr = f"{'run':<{max(12, *(len(k) for k in rows))}} {'wall s':>6} {'RSS MiB':>7}  {'KL in-dist':>10} {'vs RTN (z)':>24} {'vs llmc (z)':>24}"
    hdr += "".join(f"  {'KL ' + s:>14} {'vs RTN (z)':>24}" for s in sets[1:]) + "  guard: better/judged, stored"
    lines += [hdr, "-" * len(hdr)]
    width = max(12, *(len(k) for k in rows))
    for k, r in rows.items():
        line = f"{k:<{width}} {r['wall_s']:6.1f} {r['peak_rss_bytes'] / 2**20:7.0f}  {r[sets[0]]['kl']:10.3e} "
        line += f"{_d(r[sets[0]]['vs_rtn']) if k != 'RTN' else '':>24} {_d(r[sets[0]].get('vs_llmc')) if k != 'llmc' else '':>24}"
        for s in sets[1:]:
            line += f"  {r[s]['kl']:14.3e} {_d(r[s]['vs_rtn']) if k != 'RTN' else '':>24}"
        g = r.get("guard")
        if g and g["judged"]:
            agree = (g["calibrated_better"] * 2 > g["judged"]) == (r[sets[0]]["vs_rtn"]["mean"] < 0)
            line += (f"  {g['calibrated_better']}/{g['judged']}, {g['stored_calibrated']}/{g['total']}"
                     f" ({'agrees' if agree else 'DISAGREES'} with KL)")
            if g.get("tokens_min") is not None:
                line += f"; routed tokens/expert min {g['tokens_min']}, median {g['tokens_median']}, {g['starved']} starved"
        lines.append(line)
    for k, r in rows.items():
        if "vs_unmixed" in r[sets[0]]:
            lines.append(f"{k} - {k[: -len(' mix')]} (paired, z): " + ", ".join(
                f"{s} {_d(r[s]['vs_unmixed'])}" for s in sets))
    lines += acceptance(rows, sets)
    if "llmc" in rows and "GPTQ" in rows:
        lines.append(f"wall GPTQ / llmc {rows['GPTQ']['wall_s'] / rows['llmc']['wall_s']:.2f} (target <= 0.5)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default=",".join(CLASSES),
                    help="comma-separated: " + ", ".join([*CLASSES, *REALSHAPE]) + " (default: all but realshape-glm)")
    ap.add_argument("--realshape-budgets", default="16x64,64x64",
                    help="realshape-glm: calibration budgets, windows x tokens, comma-separated")
    ap.add_argument("--realshape-methods", default="gptq,awq", help="realshape-glm: calibrated methods at each budget")
    ap.add_argument("--num-samples", type=int, default=None, help="calibration windows (default: the class's)")
    ap.add_argument("--seq-len", type=int, default=None, help="calibration window length (default: the class's)")
    ap.add_argument("--eval-samples", type=int, default=64, help="in-distribution held-out windows (half as many off)")
    ap.add_argument("--eval-seq-len", type=int, default=64)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                    help="a row NAME: the tiny recipe (with --shipped: the shipped gptq settings) with FIELD=VALUE "
                         "replaced; METHOD=awq for AWQ (default gptq); repeatable")
    ap.add_argument("--set", choices=("tuning", "confirmation"), default=None,
                    help="the classes of one side of the split chosen before tuning (TUNING, CONFIRMATION; "
                         "docs/benchmarks.md); instead of --classes")
    ap.add_argument("--no-llmc", action="store_true", help="skip llm-compressor (experiments)")
    ap.add_argument("--mix-reversed", type=float, default=0.0, metavar="SHARE",
                    help="beside every calibrated run X, 'X mix': the same recipe calibrated on a calibration.mix of "
                         "synthetic:train and, for SHARE of the same windows, the reversed language (docs/benchmarks.md)")
    ap.add_argument("--mix-other", type=float, default=0.0, metavar="SHARE",
                    help="as --mix-reversed, the second source the other corpus (the Markov language: the other-text "
                         "eval set's language, from other documents); for two-domain-dsv3, its second training language")
    ap.add_argument("--mix-random", type=float, default=0.0, metavar="SHARE",
                    help="as --mix-reversed, the second source quantkit's `random` spec: uniform ids over the "
                         "vocabulary less special tokens (another draw than the random-ids eval set's)")
    ap.add_argument("--mix-extra", action="store_true",
                    help="a mix's second source adds SHARE x the class's windows on top of them (the first source "
                         "keeps all its windows) instead of taking SHARE of them")
    ap.add_argument("--mix-only", action="store_true",
                    help="with a --mix-* option, run the calibrated rows only in their mix form (half the runs)")
    ap.add_argument("--base", default="GPTQ,AWQ,RTN-clip",
                    help="the tiny recipe's runs beside RTN (always run), comma-separated; '' for none (variants only)")
    ap.add_argument("--llmc-from", type=Path, default=None,
                    help="reuse llm-compressor's outputs from an earlier --out folder (same classes and calibration)")
    ap.add_argument("--llmc-actorder", choices=["recipe", "static"], default="static",
                    help="llm-compressor's activation order: static (default), GPTQModifier's own default when "
                         "actorder is not passed, so the llmc rows are llm-compressor's default GPTQ; or the "
                         "recipe's gptq.actorder (false in every recipe: the like-for-like quantizer)")
    ap.add_argument("--shipped", default=None, metavar="RECIPE",
                    help="the GPTQ and AWQ rows take this real recipe's gptq settings (e.g. glm-5.2: act-order, "
                         "dampening 0.1, Hessian observer) instead of the tiny recipe's")
    ap.add_argument("--llmc-rows", default="llmc,llmc-routed",
                    help="llm-compressor runs: llmc (its default, every expert calibrated on every token), "
                         "llmc-routed (routed tokens only), comma-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="work folder, kept (results.json, logs)")
    ap.add_argument("--resume", action="store_true",
                    help="realshape-glm: reuse the finished conversions in --out's work folder (same names, same recipes)")
    ap.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="OUT",
                    help="print one markdown table from earlier runs' --out folders (their results.json) and exit")
    ap.add_argument("--plot", type=Path, default=None, metavar="PNG",
                    help="with --summarize OUT...: draw KL against calibration size (--plot-class) into PNG and exit")
    ap.add_argument("--plot-class", default="tiny-glm", help="the class --plot draws")
    ap.add_argument("--summarize-rows", default="GPTQ,AWQ", metavar="G,A",
                    help="--summarize these two rows of each run (e.g. 'GPTQ mix,AWQ mix' of a --mix-* run)")
    args = ap.parse_args(argv)
    if args.plot:
        if not args.summarize:
            ap.error("--plot needs --summarize OUT... (the runs to draw)")
        results = [r for folder in args.summarize for r in json.loads((folder / "results.json").read_text())]
        curves = plot_calibration(results, args.plot_class, args.plot)
        for s, rows in curves.items():
            for k, c in rows.items():
                print(f"{s:<11} {k:<9} " + "  ".join(f"{t}: {v:.3e}" + (f"±{e:.1e}" if e is not None else "")
                                                   for t, v, e in zip(c["tokens"], c["kl"], c["se"], strict=True)))
        return 0
    if args.summarize:
        print(summarize(args.summarize, tuple(args.summarize_rows.split(","))))
        return 0
    names = [c for c in args.classes.split(",") if c]
    if args.set:
        names = list(TUNING if args.set == "tuning" else CONFIRMATION)
    bad = [c for c in names if c not in CLASSES and c not in REALSHAPE]
    if bad:
        ap.error(f"--classes: unknown {', '.join(bad)}; choose from {', '.join([*CLASSES, *REALSHAPE])}")
    if sum(1 for v in (args.mix_reversed, args.mix_other, args.mix_random) if v) > 1:
        ap.error("--mix-reversed, --mix-other, --mix-random: one second source at a time")
    if args.resume and not args.out:
        ap.error("--resume needs --out (the work folder of the earlier run)")
    if args.out and args.out.exists() and any(args.out.iterdir()) and not args.resume:
        ap.error(f"--out {args.out}: not empty")
    import torch

    work = args.out or Path(tempfile.mkdtemp(prefix="quantkit-calib-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads))
    torch.set_num_threads(args.threads)

    def say(*a):
        print(*a, file=sys.stderr, flush=True)

    results = []
    for name in names:
        res = (run_realshape if name in REALSHAPE else run_class)(name, args, work, env, say)
        results.append(res)
        print(render(res) + "\n", flush=True)
        (work / ("results-resumed.json" if args.resume else "results.json")).write_text(
            json.dumps(results, indent=2, default=str) + "\n")
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
