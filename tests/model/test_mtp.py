"""The MTP layer: its forward against an independent oracle, its calibration in convert, its row in
validate and on the cards; a model without one shows none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from oracle import dequantized_state_dict, transformers_model
from safetensors.torch import load_file, save_file

from quantkit.checkpoint.reader import Checkpoint
from quantkit.conversion.pipeline import convert
from quantkit.validation.forward import layer_weights, run
from quantkit.validation.metrics import paired, token_kl
from quantkit.validation.mtprow import NO_MTP_ROW, mtp_card, mtp_forward, mtp_markdown, mtp_measure

TOL = 1e-4
CALIB = {"num_samples": 8, "seq_len": 64}
# Held-out windows the MTP comparisons are paired over. Each CPU trains its own tiny GLM (another
# model), and the row is mostly the main model's drift, a heavy-tailed KL: on 8 windows two point
# estimates swapped order on some builds, on 32 the paired difference was only 1.3 SE on
# one. On 128 windows of 48 tokens GPTQ's row is 4.0-4.5 SE below RTN's on the two hardest builds
# seen (scripts/mtp_row.py splits the row into the main model's drift and the MTP layer's own share).
WINDOWS = {"num_samples": 128, "seq_len": 48}


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _oracle_mtp(folder, tmp_path, ids: torch.Tensor) -> torch.Tensor:
    """vLLM's MTP formula, written here: the main model's last decoder-layer output from transformers
    (a hook, before the final norm), x = eh_proj(cat[enorm(embed(t_{i+1})) (zero at position 0),
    hnorm(h_i)]), then the MTP block as transformers' own one-layer GlmMoeDsa model fed x as
    inputs_embeds, its final norm being shared_head.norm and its head the MTP's (else the main) head.
    Weights dequantized by tests/oracle.py, not by quantkit."""
    cfg = json.loads((folder / "config.json").read_text())
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    sd = dequantized_state_dict(folder)
    p = f"model.layers.{L}."
    main = transformers_model(folder, tmp_path / "main")
    seen = {}
    main.model.layers[-1].register_forward_hook(lambda m, a, out: seen.update(h=out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        main(ids)
    h = seen["h"][:, :-1]  # h_0..h_{T-2}
    table = sd.get(p + "embed_tokens.weight", sd["model.embed_tokens.weight"])
    e = table[ids[:, 1:]]  # embed(t_1..t_{T-1})
    e[:, 0] = 0  # vLLM masks the embedding at position 0
    x = torch.cat([_rms(e, sd[p + "enorm.weight"], eps), _rms(h, sd[p + "hnorm.weight"], eps)], -1) @ sd[p + "eh_proj.weight"].T
    # the MTP block as layer 0 of a one-layer model (MoE, owns a DSA indexer, as the MTP layer does)
    extras = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    block = {"model.layers.0." + k[len(p):]: v for k, v in sd.items() if k.startswith(p) and not k[len(p):].startswith(extras)}
    block["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"]
    block["model.norm.weight"] = sd[p + "shared_head.norm.weight"]
    block["lm_head.weight"] = sd.get(p + "shared_head.head.weight", sd["lm_head.weight"])
    one = dict(cfg, num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0)
    one.pop("quantization_config", None)
    d = tmp_path / "mtp_block"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(one))
    save_file({k: v.contiguous() for k, v in block.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(inputs_embeds=x).logits  # positions 0..T-2, as vLLM runs the draft


def _last_hidden(ckpt: Checkpoint, ids: torch.Tensor) -> torch.Tensor:
    seen = {}
    run(ckpt, ids, device="cpu", on_layer=lambda layer, h: seen.update({layer: h}))
    return seen[ckpt.arch.num_hidden_layers - 1]


def test_mtp_forward_equals_the_oracle(tiny_glm, tmp_path):
    """quantkit's MTP (streamed from the checkpoint, and the weight-dict function) against vLLM's
    formula computed independently; the MTP layer's logits are not the main model's."""
    from quantkit.model.mtp import head_name, mtp_layer
    from quantkit.model.reference import Context

    ckpt = Checkpoint(tiny_glm)
    ids = torch.randint(3, ckpt.arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    theirs = _oracle_mtp(tiny_glm, tmp_path, ids)
    with torch.no_grad():
        h = _last_hidden(ckpt, ids)
        ours = mtp_forward(ckpt, h, ids, "cpu", torch.float32)
        L = ckpt.arch.num_hidden_layers
        ctx = Context.build(ckpt.arch, ids.shape[1] - 1, "cpu", torch.float32)
        table = ckpt.get("model.embed_tokens.weight")
        whole = mtp_layer(h[:, :-1], ids[:, 1:], layer_weights(ckpt, L, "cpu", torch.float32), ctx, L, table,
                          ckpt.get(head_name(ckpt.arch, L, ckpt.tensors)))
    assert ours.shape == theirs.shape == (2, 15, ckpt.arch.vocab_size)
    for mine in (ours, whole):
        err = ((mine - theirs).abs().max() / theirs.abs().max()).item()
        assert err < TOL, f"max relative error {err:.2e}"
    main = run(ckpt, ids, device="cpu")[:, :-1]
    assert (main - ours).abs().max() > 1e-2  # a different function than the main head (the test can fail)


@pytest.fixture(scope="module")
def glm_pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {m: convert("tiny:glm-5.2", root / m, method=m, validate=False, progress=False, device="cpu", **CALIB)
            for m in ("gptq", "rtn")}


def test_convert_calibrates_the_mtp_experts(glm_pairs):
    r = glm_pairs["gptq"].report
    L = 5
    mtp = [e for e in r["experts"] if e["layer"] == L]
    assert len(mtp) == 16 and all(e["method"] == "gptq" or e["guard"] == "rtn" for e in mtp)
    assert all(e["heldout"] > 0 for e in mtp)  # judged by the guard like a main layer's
    # routed on the MTP's own T - 1 positions of every calibration sequence (top-4)
    assert sum(e["tokens"] for e in mtp) == CALIB["num_samples"] * (CALIB["seq_len"] - 1) * 4
    assert r["mtp"]["calibrated_layers"] == [L] and r["mtp"]["experts_summary"]["total"] == 16
    assert r["mtp"]["experts"].endswith("GPTQ") or "RTN" in r["mtp"]["experts"]
    layer = next(lay for lay in r["layers"] if lay["layer"] == L)
    assert layer["kind"] == "mtp" and layer["calibrated"] and "kv_cache" in layer
    rtn = glm_pairs["rtn"].report["mtp"]
    assert rtn["calibrated_layers"] == [] and rtn["experts"] == "16 RTN"


@pytest.fixture(scope="module")
def measured(glm_pairs, tiny_glm):
    """The MTP rows of both converts on WINDOWS held-out windows."""
    from quantkit.inputs.tokens import load_tokens

    ids = load_tokens("synthetic:heldout", tokenizer=tiny_glm, **WINDOWS).ids
    out = {}
    with torch.no_grad():
        for m, pair in glm_pairs.items():
            ckpts = {"reference": Checkpoint(tiny_glm), "decode": Checkpoint(pair.decode)}
            hs = {k: _last_hidden(ck, ids) for k, ck in ckpts.items()}
            out[m] = mtp_measure(ckpts, hs, ids, ["decode"], "cpu", torch.float32)
            # the MTP layer alone: the decode MTP on the source's hidden states (the RTN convert's MTP
            # experts are what the MTP layer had before it was calibrated: RTN)
            ref = mtp_forward(ckpts["reference"], hs["reference"], ids, "cpu", torch.float32)
            alone = mtp_forward(ckpts["decode"], hs["reference"], ids, "cpu", torch.float32)
            out[m + "-alone"] = token_kl(ref, alone).mean(-1)  # per window
    return out


def test_calibrated_mtp_is_closer_to_the_source_than_rtn(measured):
    """validate's MTP row, the decode MTP's KL to the source MTP (each on its own model's hidden
    states): the GPTQ convert (main and MTP experts calibrated) below the RTN convert's by more than
    one standard error, paired over the same held-out windows; top-1 agreement not worse beyond 2 SE.
    The row is mostly the main model's drift (the next test isolates the MTP layer's own share)."""
    g, r = measured["gptq"]["rows"]["decode"], measured["rtn"]["rows"]["decode"]
    kl = paired(torch.tensor(g["windows"]["kl"]), torch.tensor(r["windows"]["kl"]))
    top1 = paired(torch.tensor(r["windows"]["top1"]), torch.tensor(g["windows"]["top1"]))  # RTN - GPTQ: higher is better
    print(f"MTP KL gptq {g['kl']:.4g} ± {g['kl_se']:.2g} rtn {r['kl']:.4g} ± {r['kl_se']:.2g}; paired {kl}; "
          f"top-1 {g['top1']:.4f} {r['top1']:.4f}, RTN - GPTQ {top1}")
    assert g["kl"] == pytest.approx(sum(g["windows"]["kl"]) / WINDOWS["num_samples"])
    assert kl.better(z=1.0), f"GPTQ - RTN MTP row KL: {kl}"
    assert top1.not_worse(z=2.0), f"RTN - GPTQ MTP top-1: {top1}"


def test_calibrated_mtp_layer_alone_beats_rtn(measured):
    """Both MTP layers on the source's hidden states: only the MTP layer's own weights differ (its
    experts GPTQ vs RTN; attention and the rest are the same FP8). Paired over windows: clearly lower."""
    d = paired(measured["gptq-alone"], measured["rtn-alone"])
    print(f"MTP alone: gptq {float(measured['gptq-alone'].mean()):.3g} rtn {float(measured['rtn-alone'].mean()):.3g}; {d}")
    assert d.better(z=2.0), f"GPTQ - RTN MTP KL: {d}"
    # the MTP layer's own share of the row: a few percent (0.01-0.04 on five builds); the rest is the
    # main model's drift of the hidden state the MTP reads
    assert float(measured["gptq-alone"].mean()) < 0.1 * measured["gptq"]["rows"]["decode"]["kl"]


def test_the_source_mtp_drafts_what_a_server_would_accept(measured):
    """The tiny GLM's MTP layer is trained (quantkit.synthetic.tiny.train_mtp): its draft equals the main
    model's next greedy token on at least 30% of held-out positions, so a damaged MTP layer can show."""
    ref = measured["rtn"]["reference"]
    print(f"source MTP acceptance {ref['acceptance']:.4f} ± {ref['acceptance_se']:.2g}, accuracy {ref['accuracy']:.4f}")
    assert ref["acceptance"] >= 0.30
    for m in ("gptq", "rtn"):
        r = measured[m]["rows"]["decode"]
        assert r["acceptance"] == pytest.approx(sum(r["windows"]["acceptance"]) / WINDOWS["num_samples"])
        assert r["acceptance_delta"] == pytest.approx(r["acceptance"] - ref["acceptance"])
        assert r["acceptance_delta_se"] > 0
        print(f"{m} decode MTP acceptance {r['acceptance']:.4f}, Δ {r['acceptance_delta']:+.4f} ± {r['acceptance_delta_se']:.2g}")


def _damaged_mtp(decode: Path, dst: Path) -> Path:
    """A copy of decode/ whose MTP layer's eh_proj (the projection of [embedding, hidden state] into the
    layer: BF16, as stored) has its input halves swapped: the layer reads the hidden state as the token."""
    shutil.copytree(decode, dst)
    name = "model.layers.5.eh_proj.weight"
    shard = dst / json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name].roll(tensors[name].shape[1] // 2, dims=1)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


def test_a_damaged_mtp_layer_lowers_acceptance(measured, glm_pairs, tiny_glm, tmp_path):
    """The same decode/ with its MTP layer damaged: acceptance lower beyond 2 SE, paired over the same windows."""
    from quantkit.inputs.tokens import load_tokens

    ids = load_tokens("synthetic:heldout", tokenizer=tiny_glm, **WINDOWS).ids
    ckpts = {"reference": Checkpoint(tiny_glm), "decode": Checkpoint(_damaged_mtp(glm_pairs["rtn"].decode, tmp_path / "d"))}
    with torch.no_grad():
        hs = {k: _last_hidden(ck, ids) for k, ck in ckpts.items()}
        hurt = mtp_measure(ckpts, hs, ids, ["decode"], "cpu", torch.float32)["rows"]["decode"]
    intact = measured["rtn"]["rows"]["decode"]
    d = paired(torch.tensor(hurt["windows"]["acceptance"]), torch.tensor(intact["windows"]["acceptance"]))
    print(f"MTP acceptance intact {intact['acceptance']:.4f} damaged {hurt['acceptance']:.4f}: {d}")
    assert d.better(z=2.0), f"damaged - intact MTP acceptance: {d}"
    assert hurt["windows"]["kl"] != intact["windows"]["kl"]


def test_validate_has_the_mtp_row_and_the_cards_show_it(glm_pairs):
    from quantkit.validation.pipeline import validate

    v = validate(glm_pairs["gptq"].out, eval_data="synthetic:heldout", num_samples=2, seq_len=32, gen_tokens=1,
                 device="cpu", progress=False)
    m = v.data["mtp"]
    assert m["layer"] == 5 and set(m["rows"]) == {"prefill", "decode"}
    assert m["rows"]["prefill"]["kl"] == 0 and m["rows"]["decode"]["kl"] > 0  # prefill's MTP is the source's FP8
    saved = json.loads((glm_pairs["gptq"].out / "validation.json").read_text())
    assert saved["mtp"] == json.loads(json.dumps(m))
    md = (glm_pairs["gptq"].out / "validation.md").read_text()
    assert "## MTP layer (layer 5" in md and "| decode (INT4) MTP |" in md
    card = (glm_pairs["gptq"].decode / "README.md").read_text()
    assert "| MTP layer (speculative draft) vs the source's MTP |" in card and "MTP draft accuracy" in card
    assert "MTP acceptance (the draft equals this checkpoint's own next greedy token" in card
    assert "| decode (INT4) MTP | 0." in md and "Source MTP acceptance 0." in md
    assert "- MTP layer's routed experts: 16 GPTQ" in card or "RTN" in card.split("MTP layer's routed experts:")[1][:40]
    assert "- guard: " in card and "quantized routed experts stored calibrated" in card
    assert "MTP layer:" in str(v.table().caption)


def test_kimi_has_no_mtp_row(tiny_kimi):
    ckpts = {"reference": Checkpoint(tiny_kimi), "decode": Checkpoint(tiny_kimi)}
    m = mtp_measure(ckpts, {}, torch.zeros(1, 8, dtype=torch.long), ["decode"], "cpu", torch.float32)
    assert m == {"layer": None, "note": NO_MTP_ROW}
    d = {"mtp": m}
    assert mtp_markdown(d) == [] and mtp_card("decode", d) == ([], [])
