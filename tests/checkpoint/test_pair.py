"""The pair's contract: pair.json names what prefill/ and decode/ must share for a KV cache to cross
them, and `quantkit verify` names the first difference.

The mixed pairs are made the way they happen: a decode/ from another run beside this prefill/, i.e.
one tensor changed in decode with decode's manifest and the report rewritten to match, so every
per-folder check passes and only the pair's checks can see it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.manifest import MANIFEST, REPORT, build_manifest, verify, write_manifest
from quantkit.checkpoint.pair import GROUPS, PAIR_JSON


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny GLM pair with calibration (so the KV scales are written) and a `--decode-rest bf16` one."""
    from quantkit.conversion.pipeline import convert

    root = tmp_path_factory.mktemp("pair")
    gptq = convert("tiny:glm-5.2", root / "gptq", method="gptq", num_samples=4, seq_len=32, validate=False,
                   progress=False)
    rest = convert("tiny:glm-5.2", root / "rest", method="rtn", decode_rest="bf16", validate=False, progress=False)
    return gptq.out, rest.out


def _rewrite(out: Path, which: str, name: str, edit) -> None:
    """Change one stored tensor in `which`, then rewrite that folder's manifest and the report to
    match (a checkpoint from another run, consistent in itself)."""
    wm = json.loads((out / which / "model.safetensors.index.json").read_text())["weight_map"]
    path = out / which / wm[name]
    t = load_file(path)
    t[name] = edit(t[name])
    save_file(t, path, metadata={"format": "pt"})
    old = json.loads((out / which / MANIFEST).read_text())
    report = json.loads((out / REPORT).read_text())
    report["outputs"][which]["manifest_sha256"] = write_manifest(out / which, build_manifest(out / which, old["shared"]))
    (out / REPORT).write_text(json.dumps(report))


def test_pair_json_names_every_group_with_digests(pair):
    out, _ = pair
    c = json.loads((out / PAIR_JSON).read_text())
    assert c["holds"] and c["first_difference"] is None and set(c["groups"]) == set(GROUPS)
    names = {g: {it["name"] for it in c["groups"][g]} for g in GROUPS}
    assert "model.layers.0.self_attn.k_scale" in names["kv_scales"]
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in names["attention"]
    assert "model.layers.0.self_attn.indexer.wk.weight" in names["indexer"]
    assert "model.layers.5.eh_proj.weight" in names["mtp"]  # the tiny's MTP layer
    assert {"config.json:qk_rope_head_dim", "config.json:num_nextn_predict_layers"} <= names["config"]
    assert "tokenizer.json" in names["tokenizer"]
    assert all(len(it["sha256"]) == 64 for g in GROUPS for it in c["groups"][g] if it["sha256"])
    report = json.loads((out / REPORT).read_text())["pair_contract"]
    assert report["holds"] and len(report["sha256"]) == 64
    res = verify(out)
    assert res.ok and res.pair_contract["holds"] and res.pair_contract["counts"]["kv_scales"] == 12, res.problems


@pytest.mark.parametrize("name,what", [
    ("model.layers.0.self_attn.k_scale", "kv_scales"),
    ("model.layers.2.self_attn.kv_b_proj.weight", "attention"),
    ("model.layers.2.self_attn.indexer.wk.weight", "indexer"),
])
def test_verify_names_the_tensor_a_mixed_pair_differs_in(pair, tmp_path, name, what):
    out = tmp_path / "o"
    shutil.copytree(pair[0], out)
    if name.endswith("k_scale"):
        edit = lambda t: t * 1.5  # noqa: E731 - a decode from a run calibrated on other data
    else:
        edit = lambda t: (t.to(torch.float32) * -1).to(t.dtype)  # noqa: E731 - other attention bytes
    _rewrite(out, "decode", name, edit)
    res = verify(out)
    assert not res.ok
    contract = [p for p in res.problems if p.startswith("pair contract")]
    assert contract and f"{what}: {name} differs between prefill/ and decode/" in contract[0], res.problems
    assert not res.pair_contract["holds"]


def test_verify_names_a_rope_config_difference(pair, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(pair[0], out)
    cfg = json.loads((out / "decode" / "config.json").read_text())
    cfg["rope_parameters"] = dict(cfg.get("rope_parameters") or {}, rope_theta=1.0)
    (out / "decode" / "config.json").write_text(json.dumps(cfg))
    res = verify(out)
    assert any("pair contract" in p and "config: config.json:rope_parameters differs" in p for p in res.problems), res.problems


def test_an_edited_pair_json_is_caught(pair, tmp_path):
    out = tmp_path / "o"
    shutil.copytree(pair[0], out)
    c = json.loads((out / PAIR_JSON).read_text())
    c["groups"]["kv_scales"] = []
    (out / PAIR_JSON).write_text(json.dumps(c))
    assert any("pair.json: sha256 differs" in p for p in verify(out).problems)
    (out / PAIR_JSON).unlink()
    assert any("pair.json: missing" in p for p in verify(out).problems)


def test_decode_rest_bf16_records_that_the_contract_does_not_hold(pair):
    """Kimi's official look (BF16 attention in decode) is a valid pair, but not one whose KV cache can
    cross the pools: pair.json says so and names why; verify passes and reports it."""
    _, rest = pair
    c = json.loads((rest / PAIR_JSON).read_text())
    assert not c["holds"] and c["first_difference"].startswith("attention: model.layers.0.self_attn.")
    res = verify(rest)
    assert res.ok, res.problems
    assert res.pair_contract["holds"] is False and res.pair_contract["first_difference"] == c["first_difference"]


def test_cli_verify_prints_the_contract(pair):
    from typer.testing import CliRunner

    from quantkit.cli import app

    ok = CliRunner().invoke(app, ["verify", str(pair[0]), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.output)["pair_contract"]["holds"]


def test_validate_states_the_contract_held(pair, tiny_glm, tmp_path):
    from quantkit.validation.pipeline import validate

    out = tmp_path / "o"
    shutil.copytree(pair[0], out)
    res = validate(out, reference=tiny_glm, eval_data="synthetic:heldout", num_samples=2, seq_len=16, gen_tokens=2,
                   device="cpu", progress=False, gates={})
    held = [n for n in res.data["notes"] if n.startswith("cross-phase: the pair's contract held")]
    # 72 attention + 28 indexer + 12 KV scales + 6 MTP + 24 config + 2 tokenizer (GLM's MLA caches one latent:
    # its config's key/value head count is not among the fields its cache depends on)
    assert held and "144 " in held[0], res.data["notes"]
    from quantkit.validation.targets import pair_contract_note

    rest = json.loads((pair[1] / REPORT).read_text())["pair_contract"]
    assert pair_contract_note(rest).startswith("cross-phase: the pair's contract does not hold (attention: ")


def test_config_items_are_every_familys_and_the_familys_own_cache_fields():
    """The family definition says which config.json keys its cache depends on (Family.cache_config):
    GQA's key/value heads for Qwen3-MoE, the latent's ranks and the indexer's for GLM."""
    from quantkit.checkpoint.pair import config_view
    from quantkit.model.presets import load_preset

    qwen, glm = config_view(load_preset("qwen3-30b-a3b")), config_view(load_preset("glm-5.2"))
    assert {"rope_theta", "num_attention_heads", "num_key_value_heads"} <= set(qwen) and "kv_lora_rank" not in qwen
    assert {"kv_lora_rank", "qk_rope_head_dim", "index_topk"} <= set(glm) and {"rope_theta", "rope_parameters"} & set(glm)
    assert "num_key_value_heads" not in glm  # MLA caches one latent per token, whatever the config says
    unknown = config_view({"model_type": "not_a_family", "rope_theta": 1.0, "kv_lora_rank": 8})
    assert unknown == {"model_type": "not_a_family", "rope_theta": 1.0}
