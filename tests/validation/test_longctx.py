"""validate's long-context rows (quantkit.validation.longctx): a damaged DSA indexer in decode/ changes no
number measured on windows within index_topk and fails the long-context row; a window longer than the
model's max positions is a one-line error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.conversion.pipeline import convert
from quantkit.errors import ConfigError
from quantkit.planner.budgets import long_len
from quantkit.validation.pipeline import validate

INDEXER_LAYER = 2  # owns an indexer in the tiny GLM (IndexShare: layers 0, 2, 4)
SHORT = {"num_samples": 2, "seq_len": 14, "gen_tokens": 2}  # prompt + decode step see <= 15 < index_topk 16 tokens


def _reseal(out: Path, changed: str) -> None:
    """Rewrite both manifests (`changed` no longer a tensor the pair shares), pair.json (its contract no
    longer holds) and the report's digests, as a converter that wrote the damage would."""
    from quantkit.checkpoint.manifest import MANIFEST, build_manifest, write_manifest
    from quantkit.checkpoint.pair import write_contract

    report = json.loads((out / "convert-report.json").read_text())
    for which in ("prefill", "decode"):
        shared = [e for e in json.loads((out / which / MANIFEST).read_text())["shared"] if e["decode"] != changed]
        report["outputs"][which]["manifest_sha256"] = write_manifest(out / which, build_manifest(out / which, shared))
    report["pair_contract"] = write_contract(out)
    (out / "convert-report.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_glm) -> dict[str, dict]:
    """validate (short windows + the default long window) of an RTN pair and of a copy whose decode/
    indexer has its heads' weights permuted (weights_proj rows rolled by one) at INDEXER_LAYER."""
    root = tmp_path_factory.mktemp("longctx")
    intact = convert("tiny:glm-5.2", root / "intact", method="rtn", validate=False, progress=False).out
    damaged = root / "damaged"
    shutil.copytree(intact, damaged)
    name = f"model.layers.{INDEXER_LAYER}.self_attn.indexer.weights_proj.weight"
    shard = damaged / "decode" / json.loads((damaged / "decode" / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].roll(1, dims=0)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    _reseal(damaged, name)
    return {k: validate(p, device="cpu", progress=False, **SHORT).data for k, p in (("intact", intact), ("damaged", damaged))}


def test_damaged_indexer_passes_short_windows_and_fails_the_long_context_row(runs):
    ok, hurt = runs["intact"], runs["damaged"]
    print("\nrow      short KL (both)  long KL intact/damaged  top-1 intact/damaged  overlap intact/damaged (worst layer)")
    for m in ("prefill", "decode"):
        a, b = ok["long_context"]["rows"][f"long_context_{m}"], hurt["long_context"]["rows"][f"long_context_{m}"]
        print(f"{m:8} {ok['rows'][m]['metrics']['kl']:.4g}  {a['metrics']['kl']:.4g} / {b['metrics']['kl']:.4g}  "
              f"{a['metrics']['top1']:.3f} / {b['metrics']['top1']:.3f}  {a['metrics']['indexer_overlap']:.3f} / "
              f"{b['metrics']['indexer_overlap']:.3f} ({b['indexer_overlap_worst']:.3f})")
    # within index_topk DSA selects every token: the damage changes no short-window number at all
    assert ok["rows"] == hurt["rows"] and ok["continuations"] == hurt["continuations"]
    short = [g for g in hurt["gates"] if not (g["row"] or "").startswith("long_context")]
    assert short and all(g["passed"] is not False for g in short)
    assert ok["passed"]

    lc, bad = ok["long_context"], hurt["long_context"]
    assert lc["seq_len"] == 32 and lc["index_topk"] == 16  # default: 2 x index_topk
    assert set(lc["rows"]) == {"long_context_prefill", "long_context_decode"}
    assert bad["rows"]["long_context_prefill"] == lc["rows"]["long_context_prefill"]  # prefill/ untouched
    before, after = lc["rows"]["long_context_decode"], bad["rows"]["long_context_decode"]
    layers = before["indexer_overlap_layers"]
    assert list(layers) == [0, 2, 4]
    assert after["indexer_overlap_layers"][0] == layers[0]  # identical weights up to the damaged layer
    assert after["indexer_overlap_layers"][INDEXER_LAYER] < layers[INDEXER_LAYER] - 0.1
    failed = {(g["gate"], g["row"]) for g in hurt["gates"] if g["passed"] is False}
    assert ("indexer_overlap_min", "long_context_decode") in failed and not hurt["passed"]
    md = (Path(hurt["dir"]) / "validation.md").read_text()
    assert "## Long context (past the DSA window, index_topk 16)" in md


def test_long_window_length_is_checked_up_front(tiny_glm, tiny_kimi):
    from quantkit.checkpoint.reader import Checkpoint

    glm, kimi = Checkpoint(tiny_glm).arch, Checkpoint(tiny_kimi).arch
    assert long_len(kimi, None, tiny_kimi) == 0  # no indexer: no long-context rows
    assert long_len(glm, None, tiny_glm) == 32 and long_len(glm, 0, tiny_glm) == 0
    with pytest.raises(ConfigError, match=r"max_position_embeddings 4096 .* pass --long-context <= 4096") as e:
        long_len(glm, 5000, tiny_glm)
    assert "\n" not in str(e.value) and "config.json" in str(e.value)
    with pytest.raises(ConfigError, match="not past index_topk 16"):
        long_len(glm, 16, tiny_glm)


def test_fp8_index_keys_add_a_decode_kv_row(runs, tiny_glm):
    # the long pass with the FP8 cache vLLM stores for DSA models: the same rows, plus decode/ scoring
    # FP8 index keys (the indexer's selection is where the cache's error acts in a prefill)
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.inputs.tokens import load_tokens
    from quantkit.model.kvcache import KVCache
    from quantkit.validation.longctx import long_context

    ok, out = runs["intact"], Path(runs["intact"]["dir"])
    ckpts = {"reference": Checkpoint(tiny_glm), "prefill": Checkpoint(out / "prefill"), "decode": Checkpoint(out / "decode")}
    for ck in ckpts.values():  # computed as validate computed the row it is compared with
        ck.numerics = ok["numerics"]["mode"]
    ids = load_tokens(ok["eval_data"]["spec"], tokenizer=tiny_glm, num_samples=2, seq_len=32).ids
    assert ok["long_context"]["sha256"] == load_tokens(ok["eval_data"]["spec"], tokenizer=tiny_glm, num_samples=2,
                                                       seq_len=32).sha256
    with torch.no_grad():
        lc = long_context(ckpts, ids, "cpu", torch.float32, kv=KVCache("fp8_ds_mla", "checkpoint"))
    kv, plain = lc["rows"]["long_context_decode_kv"], lc["rows"]["long_context_decode"]
    print(f"\ndecode long rows: BF16 cache overlap {plain['metrics']['indexer_overlap']:.4f} KL {plain['metrics']['kl']:.4g}; "
          f"FP8 index keys overlap {kv['metrics']['indexer_overlap']:.4f} KL {kv['metrics']['kl']:.4g}")
    assert plain == ok["long_context"]["rows"]["long_context_decode"]  # the extra stream changes no other row
    assert 0.9 < kv["metrics"]["indexer_overlap"] <= 1 and kv["indexer_overlap_layers"][0] <= 1
