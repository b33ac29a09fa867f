"""`quantkit validate`: exact zeros on the source itself, a damaged expert caught at its layer and by a
gate, the cross-phase path against an independent mixed-weights forward, and the CLI's files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from quantkit.checkpoint.reader import Checkpoint
from quantkit.cli import app
from quantkit.conversion.pipeline import convert
from quantkit.errors import ConfigError
from quantkit.inputs.tokens import load_tokens
from quantkit.model.reference import Context, decoder_layer
from quantkit.validation.forward import embed, head, layer_weights, run
from quantkit.validation.pipeline import GATES_FAILED_EXIT, cross_phase_logits, validate

runner = CliRunner()
DAMAGED_LAYER = 2  # an MoE layer of the tiny GLM (layer 0 is dense), with an indexer (DSA)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, tiny_glm, tiny_kimi) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pairs")
    return {name: convert(spec, root / name, validate=False, progress=False).out
            for name, spec in (("glm", "tiny:glm-5.2"), ("kimi", "tiny:kimi-k2.6"))}


@pytest.fixture(scope="module")
def cli_runs(pairs) -> dict[str, tuple]:
    """`quantkit validate DIR` on both pairs with the recipe's settings: (result, validation.json)."""
    out = {}
    for name, folder in pairs.items():
        res = runner.invoke(app, ["validate", str(folder), "--device", "cpu"])
        out[name] = (res, json.loads((folder / "validation.json").read_text()))
    return out


def test_source_against_itself_is_exactly_zero(tmp_path, tiny_glm, tiny_kimi):
    # a "pair" whose prefill and decode are both the source: every path, cross-phase included
    (tmp_path / "self").mkdir()
    (tmp_path / "self" / "prefill").symlink_to(tiny_glm, target_is_directory=True)
    (tmp_path / "self" / "decode").symlink_to(tiny_glm, target_is_directory=True)
    res = validate(tmp_path / "self", reference="tiny:glm-5.2", num_samples=2, seq_len=32, gen_tokens=3,
                   device="cpu", progress=False)
    rows = res.data["rows"]
    assert set(rows) == {"prefill", "decode", "cross_phase"}
    for row in rows.values():
        assert row["layers"] == [0.0] * 5
        m = row["metrics"]
        assert m["kl"] == 0.0 and m["top1"] == 1.0 and m["layer_rel_err"] == 0.0 and m["greedy_agree"] == 1.0
    assert rows["prefill"]["metrics"]["ppl_delta"] == 0.0 and rows["decode"]["metrics"]["ppl_delta"] == 0.0
    assert rows["cross_phase"]["int4_only"]["layers"] == [0.0] * 5
    assert res.passed and (tmp_path / "self" / "validation.json").is_file()
    assert not (tiny_glm / "README.md").exists()  # no report, no cards: nothing written into the source

    # one checkpoint folder against a reference (nothing written: the folder is the shared tiny cache)
    single = validate(tiny_kimi, reference=tiny_kimi, num_samples=2, seq_len=16, gen_tokens=2, device="cpu",
                      progress=False, write=False)
    assert set(single.data["rows"]) == {"model"}
    assert single.data["rows"]["model"]["layers"] == [0.0] * 4 and single.data["rows"]["model"]["metrics"]["kl"] == 0.0


def _damage(pair: Path, dst: Path) -> tuple[Path, int]:
    """Copy a convert output and multiply one routed expert's INT4 scales by 32 (the busiest expert of
    DAMAGED_LAYER in calibration, so the eval tokens surely reach it). The layer's error grows about
    linearly with the factor; x8 raised it 3x above the intact pair's worst layer on one machine's build of
    the tiny GLM but only 1.9x on another's (0.19 vs a bound of 0.30), and x32 clears the bound on both."""
    shutil.copytree(pair, dst)
    report = json.loads((pair / "convert-report.json").read_text())
    e = max((x for x in report["experts"] if x["layer"] == DAMAGED_LAYER), key=lambda x: x["tokens"])["expert"]
    name = f"model.layers.{DAMAGED_LAYER}.mlp.experts.{e}.down_proj.weight_scale"
    shard = dst / "decode" / json.loads((dst / "decode" / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name] * 32
    save_file(tensors, str(shard), metadata={"format": "pt"})
    for stale in ("validation.json", "validation.md", "validation.png"):
        (dst / stale).unlink(missing_ok=True)
    return dst, e


def _reseal(out: Path) -> None:
    """Rewrite both manifests (keeping the shared list) and the report's digests, as a buggy convert would."""
    from quantkit.checkpoint.manifest import MANIFEST, build_manifest, write_manifest

    report = json.loads((out / "convert-report.json").read_text())
    for which in ("prefill", "decode"):
        shared = json.loads((out / which / MANIFEST).read_text())["shared"]
        report["outputs"][which]["manifest_sha256"] = write_manifest(out / which, build_manifest(out / which, shared))
    (out / "convert-report.json").write_text(json.dumps(report))


def test_damaged_expert_shows_at_its_layer_and_fails_a_gate(tmp_path, pairs):
    intact = tmp_path / "intact"
    shutil.copytree(pairs["glm"], intact)
    damaged, e = _damage(pairs["glm"], tmp_path / "damaged")
    # The gate is set from the intact pair's own worst layer (x3), not from one machine's numbers:
    # the claim is that one broken expert stands out at its layer, whatever the build of the model.
    probe = validate(intact, num_samples=4, gen_tokens=4, device="cpu", progress=False, write=False).data["rows"]
    bound = 3 * max(max(probe[r]["layers"]) for r in ("decode", "cross_phase"))
    gates = tmp_path / "gates.yaml"
    gates.write_text(f"gates:\n  kl_max: 0.05\n  top1_min: 0.9\n  layer_rel_err_max: {bound}\n")

    opts = ["--device", "cpu", "--num-samples", "4", "--gen-tokens", "4", "--gate", str(gates)]
    # validate verifies first: bytes changed after convert are refused before anything is measured
    refused = runner.invoke(app, ["validate", str(damaged), *opts])
    assert refused.exit_code == 1 and f"experts.{e}.down_proj.weight_scale" in refused.output, refused.output
    assert not (damaged / "validation.json").exists()
    _reseal(damaged)  # from here on the damage is the converter's own (a manifest that agrees with it)
    good = runner.invoke(app, ["validate", str(intact), *opts])
    assert good.exit_code == 0, good.output
    ok = json.loads((intact / "validation.json").read_text())
    bad = runner.invoke(app, ["validate", str(damaged), *opts])
    assert bad.exit_code == GATES_FAILED_EXIT, bad.output
    assert "validation failed" in bad.output and "layer_rel_err_max on decode" in bad.output
    hurt = json.loads((damaged / "validation.json").read_text())

    before, after = ok["rows"]["decode"]["layers"], hurt["rows"]["decode"]["layers"]
    assert after[:DAMAGED_LAYER] == before[:DAMAGED_LAYER]  # identical weights up to there: identical error
    assert after[DAMAGED_LAYER] > 10 * before[DAMAGED_LAYER] and after[DAMAGED_LAYER] > bound
    assert max(range(len(after)), key=lambda i: after[i] - before[i]) == DAMAGED_LAYER  # the jump is at that layer
    assert hurt["rows"]["prefill"]["layers"] == ok["rows"]["prefill"]["layers"]  # prefill/ was not touched
    cp_before, cp_after = ok["rows"]["cross_phase"]["layers"], hurt["rows"]["cross_phase"]["layers"]
    assert cp_after[:DAMAGED_LAYER] == cp_before[:DAMAGED_LAYER] and cp_after[DAMAGED_LAYER] > bound
    failed = {(g["gate"], g["row"]) for g in hurt["gates"] if g["passed"] is False}
    assert ("layer_rel_err_max", "decode") in failed and ("layer_rel_err_max", "cross_phase") in failed
    assert not hurt["passed"] and ok["passed"]


def _mixed_forward(prefill: Checkpoint, decode: Checkpoint, ids: torch.Tensor, P: int) -> torch.Tensor:
    """Last-position logits of one full (non-incremental) forward over `ids` in which positions < P run
    the prefill weights and the rest the decode weights; every position sees the previous layer's mix."""
    T = ids.shape[1]
    with torch.no_grad():
        h = torch.cat([embed(prefill, ids[:, :P], "cpu", torch.float32), embed(decode, ids[:, P:], "cpu", torch.float32)], 1)
        ctx_p = Context.build(prefill.arch, T, "cpu", torch.float32)
        ctx_d = Context.build(decode.arch, T, "cpu", torch.float32)
        for layer in range(prefill.arch.num_hidden_layers):
            hp = decoder_layer(h, layer_weights(prefill, layer, "cpu", torch.float32), ctx_p, layer).hidden
            hd = decoder_layer(h, layer_weights(decode, layer, "cpu", torch.float32), ctx_d, layer).hidden
            h = torch.cat([hp[:, :P], hd[:, P:]], dim=1)
        return head(decode, h, torch.float32)[:, -1]


def test_cross_phase_equals_a_mixed_weights_forward(pairs, tiny_glm):
    # GLM: prompts longer than index_topk, so the DSA index-key cache and IndexShare are in play
    prefill, decode = Checkpoint(pairs["glm"] / "prefill"), Checkpoint(pairs["glm"] / "decode")
    ids = load_tokens("synthetic:heldout", tokenizer=None, num_samples=2, seq_len=40).ids
    assert ids.shape[1] > prefill.arch.index_topk
    P = ids.shape[1]
    t1 = run(prefill, ids, device="cpu")[:, -1].argmax(-1)  # the prefill pool picks the first token
    seq = torch.cat([ids, t1[:, None]], dim=1)

    got = cross_phase_logits(prefill, decode, ids, t1[:, None], device="cpu")[:, 0]
    want = _mixed_forward(prefill, decode, seq, P)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the check has teeth: INT4-only and FP8-only forwards of the same sequence are far outside that tolerance
    for other in (run(decode, seq, device="cpu")[:, -1], run(prefill, seq, device="cpu")[:, -1]):
        assert not torch.allclose(other, want, rtol=1e-4, atol=1e-4)

    # and it is the path validate() measures: its greedy cross-phase continuation starts with the prefill
    # checkpoint's token, then the decode checkpoint's argmax on top of the prefill caches ...
    # (the oracle above runs the dequantized weights: validate in weights numerics, so both compute the same
    # thing; the engine-numerics forward has its own independent oracle in test_numerics.py)
    res = validate(pairs["glm"], num_samples=2, seq_len=40, gen_tokens=2, device="cpu", progress=False, write=False,
                   numerics="weights")
    cont = res.data["continuations"]
    assert [c[0] for c in cont["cross_phase"]] == [c[0] for c in cont["prefill"]] == t1.tolist()
    assert [c[1] for c in cont["cross_phase"]] == want.argmax(-1).tolist()
    # ... and its decode-step KL (fed the reference's first token) is KL(reference || mixed forward)
    ref = Checkpoint(tiny_glm)
    r1 = run(ref, ids, device="cpu")[:, -1].argmax(-1)
    seq_r = torch.cat([ids, r1[:, None]], dim=1)
    lp_ref = torch.log_softmax(run(ref, seq_r, device="cpu")[:, -1].double(), -1)
    lp_mix = torch.log_softmax(_mixed_forward(prefill, decode, seq_r, P).double(), -1)
    kl = float((lp_ref.exp() * (lp_ref - lp_mix)).sum(-1).mean())
    assert res.data["rows"]["cross_phase"]["metrics"]["kl"] == pytest.approx(kl, rel=1e-2)
    # INT4-only is told apart at the tolerance that equality was checked with
    assert res.data["rows"]["cross_phase"]["int4_only"]["kl"] != pytest.approx(kl, rel=1e-2)


@pytest.mark.parametrize("name", ["glm", "kimi"])
def test_cli_writes_table_json_md_png_and_cards(cli_runs, pairs, name):
    res, data = cli_runs[name]
    folder = pairs[name]
    assert res.exit_code == 0, res.output
    assert "quantkit validate" in res.output and "PASSED" in res.output and "cross-phase" in res.output
    assert data["passed"] and data["eval_data"]["spec"] == "synthetic:heldout" and len(data["eval_data"]["sha256"]) == 64
    assert data["device"] == "cpu" and data["dtype"] == "float32" and data["gen_tokens"] == 8
    assert set(data["rows"]) == {"prefill", "decode", "cross_phase"}
    for row in data["rows"].values():
        assert len(row["layers"]) == data["num_layers"]
    assert 0 < data["rows"]["decode"]["metrics"]["kl"] < 0.05
    assert "| `kl_max` | decode |" in (folder / "validation.md").read_text()

    png = folder / "validation.png"
    assert png.stat().st_size > 10_000
    import matplotlib.image

    img = matplotlib.image.imread(str(png))
    assert img.ndim == 3 and img.shape[1] > 1000 and img.std() > 0.05  # a real figure, not a blank canvas
    assert (folder / "validation-experts.png").stat().st_size > 5_000  # the per-expert map (tests/validation/test_expertmap.py)

    report = json.loads((folder / "convert-report.json").read_text())
    for which in ("prefill", "decode"):
        card = (folder / which / "README.md").read_text()
        assert card.startswith("---\n") and f"`{report['source']['spec']}`" in card
        assert report["outputs"][which]["precision"]["routed_expert"] in card
        assert report["calibration"] is None or report["calibration"]["sha256"] in card
        assert data["eval_data"]["sha256"] in card and "--kv-cache-dtype fp8_e4m3" in card
        assert "disable-shared-experts-fusion` is **not** needed" in card  # tiny: 16 routed experts, SGLang never fuses
        assert format(data["rows"][which]["metrics"]["kl"], ".4g") in card  # numbers come from the JSON
        assert "validation-experts.png" in card
        assert "### Calibration coverage of the routed experts" in card  # one row per MoE layer (MTP included)
        assert all(f"\n| {row['layer']} | {row['experts']} | " in card for row in report["coverage"])
    assert format(data["rows"]["cross_phase"]["metrics"]["kl"], ".4g") in (folder / "decode" / "README.md").read_text()
    assert ("--trust-remote-code" in (folder / "decode" / "README.md").read_text()) == (name == "kimi")


def test_gates_from_file_and_json_output(tmp_path, pairs):
    small = ["--num-samples", "2", "--seq-len", "16", "--gen-tokens", "2", "--device", "cpu"]
    strict = tmp_path / "strict.json"
    strict.write_text(json.dumps({"kl_max": 1e-9, "cross_phase.greedy_agree_min": 0.5}))
    res = runner.invoke(app, ["validate", str(pairs["kimi"]), "--gate", str(strict), "--json", *small])
    assert res.exit_code == GATES_FAILED_EXIT
    data = json.loads(res.stdout)
    assert data["gates_from"] == str(strict) and not data["passed"]
    by = {(g["gate"], g["row"]): g["passed"] for g in data["gates"]}
    assert by[("kl_max", "prefill")] is False and by[("kl_max", "decode")] is False
    assert by[("cross_phase.greedy_agree_min", "cross_phase")] is True
    assert ("cross_phase.greedy_agree_min", "prefill") not in by  # a scoped gate holds for its row only

    loose = tmp_path / "loose.yaml"
    loose.write_text("kl_max: 1.0\nppl_delta_max: 1.0\n")
    ok = runner.invoke(app, ["validate", str(pairs["kimi"]), "--gate", str(loose), "--json", *small])
    assert ok.exit_code == 0 and json.loads(ok.stdout)["passed"]

    typo = tmp_path / "typo.yaml"
    typo.write_text("kl_maks: 0.05\n")
    bad = runner.invoke(app, ["validate", str(pairs["kimi"]), "--gate", str(typo), *small])
    assert bad.exit_code == 1 and "unknown gate 'kl_maks'; did you mean 'kl_max'?" in bad.output


def test_needs_a_reference_without_a_report(tmp_path):
    (tmp_path / "empty").mkdir()
    res = runner.invoke(app, ["validate", str(tmp_path / "empty")])
    assert res.exit_code == 1 and "neither a convert output" in res.output


def test_cards_keep_the_source_license(tmp_path, pairs, cli_runs):
    from quantkit.validation.card import write_cards

    _, data = cli_runs["kimi"]
    report = json.loads((pairs["kimi"] / "convert-report.json").read_text())
    for which in ("prefill", "decode"):  # what convert carries over from a real source
        (tmp_path / which).mkdir()
        (tmp_path / which / "README.md").write_text("---\nlicense: other\nlicense_name: modified-mit\n---\n# Kimi K2.6\n")
    paths = write_cards(tmp_path, report, data)
    for which, path in paths.items():
        card = path.read_text()
        assert card.startswith('---\nlicense: "other"\nlicense_name: "modified-mit"\n') and "# Kimi K2.6\n" not in card
        assert f"# tiny:kimi-k2.6: {'FP8 prefill' if which == 'prefill' else 'INT4 decode'} checkpoint" in card


def test_kept_weights_are_read_once_and_change_no_number(pairs):
    """`auto` keeps the checkpoints in memory as stored (they fit): every stored byte is read at most
    once, where `stream` re-reads the layers for every greedy token; a budget that holds half the
    share keeps a prefix (the shared tensors first) and streams the rest. The numbers are the same
    to the bit in all three: the kept bytes are dequantized as the read ones are."""
    from quantkit.planner.budgets import validate_working_set

    kw = dict(num_samples=2, seq_len=16, gen_tokens=3, device="cpu", progress=False, write=False)
    auto = validate(pairs["glm"], **kw)
    stream = validate(pairs["glm"], weights="stream", **kw)
    w = auto.data["weights"]
    share = w["share_bytes_per_rank"][0]
    assert w["mode"] == "resident" and w["kept_bytes_per_rank"] == [share] and w["read_bytes_per_rank"][0] <= share
    s = stream.data["weights"]
    assert s["mode"] == "stream" and s["kept_bytes_per_rank"] == [0] and s["read_bytes_per_rank"][0] > 2 * share
    fixed, per = validate_working_set(Checkpoint(pairs["glm"] / "prefill").arch, "cpu")
    half = validate(pairs["glm"], max_host_memory=fixed + per + share // 2, **kw)
    h = half.data["weights"]
    assert h["mode"] == "partly resident" and 0 < h["kept_bytes_per_rank"][0] <= share // 2
    assert w["read_bytes_per_rank"][0] < h["read_bytes_per_rank"][0] < s["read_bytes_per_rank"][0]
    for other in (stream, half):
        assert other.data["rows"] == auto.data["rows"] and other.data["continuations"] == auto.data["continuations"]
    with pytest.raises(ConfigError, match="--weights resident: .* use more ranks"):
        validate(pairs["glm"], weights="resident", max_host_memory=fixed + per + share // 2, **kw)


def test_a_scoped_gate_replaces_the_unscoped_one_on_its_row():
    from quantkit.validation.gates import check_gates

    rows = {"decode": {"metrics": {"kl": 0.05, "top1": 0.9}}, "cross_phase": {"metrics": {"kl": 0.05, "top1": 0.9}}}
    res = check_gates({"kl_max": 0.02, "cross_phase.kl_max": 0.1, "top1_min": 0.95}, rows)
    by = {(g["gate"], g["row"]): g["passed"] for g in res}
    assert by == {("kl_max", "decode"): False, ("cross_phase.kl_max", "cross_phase"): True,
                  ("top1_min", "decode"): False, ("top1_min", "cross_phase"): False}


def test_eval_windows_whose_hidden_states_exceed_the_budget_are_refused_before_layer_0(pairs):
    """100000 x 4096 eval tokens ended in the allocator's "can't allocate memory" traceback after the
    planner had sized everything else; now one line naming the windows, the bytes and the fix."""
    from typer.testing import CliRunner

    from quantkit.cli import app

    before = sorted(p.name for p in pairs["glm"].iterdir())
    # the same at the tiny model's scale (100000 x 4096 held-out tokens take minutes to make): 64 x 64 tokens'
    # hidden states for three checkpoints are 25 MB
    r = CliRunner().invoke(app, ["validate", str(pairs["glm"]), "--num-samples", "64", "--seq-len", "64",
                                 "--device", "cpu", "--max-host-memory", "20MB"])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1 and "Traceback" not in r.output, r.output
    assert "64 x 64 eval tokens" in lines[0] and "more than the 20.00 MB budget" in lines[0], lines[0]
    assert "--num-samples" in lines[0] and "--max-host-memory" in lines[0]
    assert sorted(p.name for p in pairs["glm"].iterdir()) == before  # nothing written
