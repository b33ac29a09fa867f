"""scripts/bench_calibration.py: the pieces its verdicts rest on (fast). The whole suite takes
tens of minutes and is run by hand (docs/benchmarks.md, "Quality against RTN and llm-compressor")."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_calibration", ROOT / "scripts" / "bench_calibration.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_outlier_columns_scale_one_in_64_input_columns(bench):
    w = torch.ones(8, 256)
    t = {"model.layers.1.mlp.experts.0.up_proj.weight": w.clone(), "model.layers.1.self_attn.o_proj.weight": w.clone()}
    bench._outlier_columns(t, 1 / 64, 4.0, seed=0)
    e = t["model.layers.1.mlp.experts.0.up_proj.weight"]
    assert int((e[0] == 4).sum()) == 4 and bool((e == e[0]).all())  # whole columns, 256 / 64 of them
    assert bool((t["model.layers.1.self_attn.o_proj.weight"] == 1).all())  # experts only


def test_guard_summary_counts_the_verdicts(bench):
    experts = [{"method": "gptq", "err": 1.0, "err_rtn": 2.0}, {"method": "rtn", "err": 3.0, "err_rtn": 2.0, "guard": "rtn"},
               {"method": "rtn", "err": None, "err_rtn": None}]  # an MTP expert: RTN, never judged
    g = bench.guard_summary(experts)
    assert (g["judged"], g["calibrated_better"], g["stored_calibrated"], g["total"]) == (2, 1, 1, 3)
    assert g["mean_rel_err_vs_rtn"] == pytest.approx((-0.5 + 0.5) / 2)


def test_eval_sets_are_other_documents_and_other_kinds(bench):
    from quantkit.synthetic.tiny import batches

    sets = bench.eval_sets(4, 16, 512)
    calib = batches(64, 16, 0)
    assert not any(bool((w == c).all()) for w in sets["in-dist"] for c in calib)
    assert sets["random-ids"].shape == (2, 16) and int(sets["random-ids"].max()) < 512
    assert torch.equal(sets["reversed"], batches(2, 16, bench.REVERSED_SEED).flip(-1))
    # other text: the other corpus (another grammar and other token frequencies), in the vocabulary
    other = sets["other-text"]
    assert other.shape == (2, 16) and int(other.max()) < 512 and torch.equal(other, bench.markov_windows(2, 16, bench.OTHER_TEXT_SEED))
    assert torch.equal(bench.eval_sets(4, 16, 512, "markov")["other-text"], batches(2, 16, bench.OTHER_TEXT_SEED))


def test_shipped_rows_take_the_real_recipes_gptq_settings(bench, tmp_path):
    from quantkit.recipe import load_recipe

    r = load_recipe(bench.variant_recipe("tiny-kimi-k2.6", bench.shipped_fields("kimi-k2.6"), tmp_path / "s.yaml"))
    ship, tiny = load_recipe("kimi-k2.6"), load_recipe("tiny-kimi-k2.6")
    assert r.gptq == ship.gptq and r.group_size == tiny.group_size and r.calibration == tiny.calibration


def test_acceptance_line_names_each_bar_and_the_worst_set(bench):
    def row(*z, llmc=None):
        d = {s: {"vs_rtn": {"mean": v, "se": 1.0}} for s, v in zip(("in-dist", "other-text", "random-ids"), z)}
        if llmc is not None:
            d["in-dist"]["vs_llmc"] = {"mean": llmc, "se": 1.0}
        return d

    lines = bench.acceptance({"GPTQ": row(-3, 0.5, 1.5, llmc=0.2), "AWQ": row(-1, -2, -4)}, ["in-dist", "other-text", "random-ids"])
    assert lines[0] == ("acceptance GPTQ: in-dist vs RTN -3.0 (met), worst set vs RTN random-ids +1.5 (NOT met), "
                        "vs llmc +0.2 (met)")
    assert lines[1] == "acceptance AWQ: in-dist vs RTN -1.0 (NOT met), worst set vs RTN in-dist -1.0 (met)"


def test_variant_recipe_changes_only_the_named_field(bench, tmp_path):
    from quantkit.recipe import load_recipe

    p = bench.variant_recipe("tiny-glm-5.2", {"gptq.dampening": "0.1"}, tmp_path / "v.yaml")
    r, base = load_recipe(p), load_recipe("tiny-glm-5.2")
    assert r.gptq.dampening == 0.1 and r.gptq.block_size == base.gptq.block_size and r.method == base.method


def test_mix_recipe_keeps_the_total_and_holds_out_the_eval_sets(bench, tmp_path):
    """--mix-reversed: a quarter of the same windows from the reversed language, none of them an eval window."""
    import numpy as np

    from quantkit.recipe import load_recipe, recipe_overrides

    second = bench.mix_second_source((32, 16), tmp_path)
    r = load_recipe(bench.mix_recipe("tiny-glm-5.2", second, 0.25, tmp_path / "mix.yaml"))
    r = recipe_overrides(r, num_samples=32, seq_len=16)  # the bench's --num-samples / --seq-len, as convert applies them
    assert r.calibration.sources() == [("synthetic:train", 24), (str(second), 8)] and r.calibration.dataset is None
    rev = torch.from_numpy(np.load(second))
    evals = bench.eval_sets(4, 16, 512)["reversed"]
    assert not any(bool((w == c).all()) for w in evals for c in rev)


def test_mix_random_extra_rows_are_the_shipped_extra_random(bench, tmp_path):
    """--mix-random 0.25 --mix-extra: a mix row calibrates on the class's windows and a quarter more of
    quantkit's `random` spec, the same sources (so the same ids: convert hands both to load_mix) as a
    recipe with the real recipes' calibration.extra_random at the class's windows."""
    from quantkit.recipe import load_recipe, recipe_overrides

    second = bench.mix_second_source((32, 16), tmp_path, "random")
    mixed = recipe_overrides(load_recipe(bench.mix_recipe("tiny-glm-5.2", second, 8 / 40, tmp_path / "m.yaml")),
                             num_samples=40, seq_len=16)  # what run_class gives a mix row under --mix-extra
    extra = load_recipe("glm-5.2").calibration.extra_random
    shipped = recipe_overrides(load_recipe(bench.variant_recipe(
        "tiny-glm-5.2", {"calibration.extra_random": str(extra)}, tmp_path / "s.yaml")), num_samples=32, seq_len=16)
    assert mixed.calibration.sources() == shipped.calibration.sources() == [("synthetic:train", 32), ("random", 8)]
    assert mixed.calibration.seed == shipped.calibration.seed


def test_mix_only_runs_the_calibrated_rows_in_their_mix_form_alone(bench, tmp_path):
    """--mix-only keeps RTN (every z is against it) and drops the unmixed calibrated rows; --mix-extra
    adds SHARE x the class's windows to a mix row."""
    import argparse

    from quantkit.recipe import load_recipe

    args = argparse.Namespace(base="GPTQ", shipped=None, variant=["G01:gptq.dampening=0.01"], mix_reversed=0.0,
                              mix_other=0.0, mix_random=0.25, mix_extra=True, mix_only=False)
    plan, mixed = bench.run_plan(args, "tiny-glm-5.2", tmp_path, (32, 16), "synthetic:train", "synthetic", "c")
    assert [k for k, _, _ in plan] == ["RTN", "GPTQ", "G01", "GPTQ mix", "G01 mix"] and mixed == (40, 16)
    args.mix_only = True
    plan, _ = bench.run_plan(args, "tiny-glm-5.2", tmp_path, (32, 16), "synthetic:train", "synthetic", "c")
    assert [k for k, _, _ in plan] == ["RTN", "GPTQ mix", "G01 mix"]
    assert load_recipe(plan[2][2]).gptq.dampening == 0.01  # the variant's fields reach its mix form


def test_mix_other_is_the_markov_language_from_documents_no_eval_set_or_training_has(bench, tmp_path):
    """--mix-other: the second source is the other-text eval set's language, from other documents, and not
    two-domain-dsv3's training windows."""
    import numpy as np

    second = torch.from_numpy(np.load(bench.mix_second_source((8, 16), tmp_path, "other")))
    assert torch.equal(second, bench.markov_windows(8, 16, bench.MIX_OTHER_SEED))
    held = [bench.eval_sets(4, 16, 512)["other-text"], bench.markov_windows(8, 16, 100_000)]  # eval; training's first
    assert not any(bool((w == c).all()) for h in held for w in h for c in second)


def test_two_domain_training_windows_alternate_the_languages(bench, monkeypatch, tmp_path):
    """two-domain-dsv3 trains on 8 synthetic-corpus and 8 Markov windows a step (the training itself is the
    bench's, checked by hand: docs/benchmarks.md)."""
    from quantkit.synthetic.tiny import batches

    seen = {}
    monkeypatch.setattr(bench, "_train_dsv3", lambda folder, data, steps: seen.update(data=data, steps=steps))
    bench._two_domain_dsv3(tmp_path, steps=3)
    d = seen["data"]
    assert d.shape == (48, 64) and seen["steps"] == 3
    assert torch.equal(d[16:24], batches(8, 64, 1)) and torch.equal(d[24:32], bench.markov_windows(24, 64, 100_000)[8:16])


def test_guard_summary_counts_starved_experts_and_routed_tokens(bench):
    experts = [{"method": "gptq", "err": 1.0, "err_rtn": 2.0, "tokens": 40},
               {"method": "gptq", "err": 1.0, "err_rtn": 2.0, "tokens": 3, "fallback": "all_tokens"},
               {"method": "gptq", "err": 1.0, "err_rtn": 2.0, "tokens": 90}]
    g = bench.guard_summary(experts)
    assert (g["starved"], g["tokens_min"], g["tokens_median"]) == (1, 3, 40)


def test_last_layer_log_probs_equal_the_full_forward(bench):
    """realshape-glm's quality: the layers before the last run once, from the source; only the last
    layer and the head per checkpoint. On one checkpoint that is the full forward."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.inputs.modelspec import resolve
    from quantkit.validation.forward import logits

    src = Path(resolve("tiny:glm-5.2"))
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    lp = bench.last_layer_log_probs({"source": Checkpoint(src), "again": Checkpoint(src)}, ids)
    want = logits(src, ids, device="cpu").log_softmax(-1)
    torch.testing.assert_close(lp["source"], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(lp["source"], lp["again"])


def test_summarize_prints_one_row_per_class_and_size(bench, tmp_path):
    import json

    def row(z_rtn, z_llmc=None, wall=10.0):
        d = {s: {"vs_rtn": {"mean": z, "se": 1.0}} for s, z in zip(("in-dist", "random-ids"), z_rtn)}
        if z_llmc is not None:
            d["in-dist"]["vs_llmc"] = {"mean": z_llmc, "se": 1.0}
        return d | {"wall_s": wall, "peak_rss_bytes": 2**20 * 100}

    res = {"class": "tiny-glm", "calibration": "synthetic:train 32x64", "eval": {"in-dist": [4, 16], "random-ids": [2, 16]},
           "rows": {"RTN": row((0, 0)), "GPTQ": row((-3, 0.5), 0.2, wall=2.0) | {"planned_peak_bytes": 2**20 * 80},
                    "AWQ": row((-4, -1), -0.1), "llmc": row((-3, 2))}}
    (tmp_path / "results.json").write_text(json.dumps([res]))
    table = bench.summarize([tmp_path]).splitlines()
    # the last column: measured peak over the planner's prediction (AWQ's run predates the record: "-")
    assert len(table) == 3 and table[2] == ("| tiny-glm | 32x64 | -3.0 / random-ids +0.5 / +0.2 | -4.0 / random-ids -1.0 / -0.1 | "
                                            "random-ids +2.0 | 0.20 | 100 / 100 / 100 | 1.25 / - |")


def test_summarize_adds_the_probe_column_from_the_runs_reports(bench, tmp_path):
    """With gptq.low_dampening the runs' convert reports (logs/<run>.log) carry the probe's counts:
    one more column, admitted / judged and stored at the low dampening, per method."""
    import json

    row = {s: {"vs_rtn": {"mean": -3.0, "se": 1.0}} for s in ("in-dist", "random-ids")} | {"wall_s": 1.0,
                                                                                           "peak_rss_bytes": 2**20}
    res = {"class": "tiny-glm", "calibration": "synthetic:train 32x64", "eval": {"in-dist": [4, 16], "random-ids": [2, 16]},
           "rows": {"RTN": row, "GPTQ": row, "AWQ": row}}
    (tmp_path / "results.json").write_text(json.dumps([res]))
    (tmp_path / "tiny-glm" / "logs").mkdir(parents=True)
    summary = {"probe_judged": 64, "probe_admitted_low": 60, "low_dampening": 58}
    (tmp_path / "tiny-glm" / "logs" / "GPTQ.log").write_text(json.dumps({"experts_summary": summary}))
    table = bench.summarize([tmp_path]).splitlines()
    assert table[0].endswith("probe, GPTQ / AWQ: low admitted / judged, stored low |")
    assert table[2].endswith("| - / - | 60/64, 58 / - |")


def test_calibration_figure_plots_kl_and_se_by_calibration_size(bench, tmp_path):
    def run(size, kl):
        rows = {k: {"in-dist": {"kl": v, "kl_se": v / 10}, "random-ids": {"kl": 2 * v}} for k, v in kl.items()}
        return {"class": "tiny-glm", "calibration": f"synthetic:train {size}", "eval": {"in-dist": [4, 8], "random-ids": [2, 8]},
                "rows": rows}

    results = [run("128x128", {"RTN": 6e-3, "GPTQ mix": 2e-3, "llmc": 2.5e-3}), run("32x64", {"RTN": 6e-3, "GPTQ mix": 3e-3}),
               {"class": "other", "calibration": "synthetic:train 8x8", "eval": {}, "rows": {}}]
    curves = bench.plot_calibration(results, "tiny-glm", tmp_path / "kl.png")
    assert list(curves) == ["in-dist", "random-ids"]
    c = curves["in-dist"]
    assert c["GPTQ mix"]["tokens"] == [2048, 16384] and c["GPTQ mix"]["kl"] == [3e-3, 2e-3]  # sorted by size
    assert c["GPTQ mix"]["se"] == pytest.approx([3e-4, 2e-4])
    assert c["llmc"]["tokens"] == [16384] and c["RTN"]["kl"] == [6e-3, 6e-3]
    assert curves["random-ids"]["RTN"]["se"] == [None, None]  # not recorded: drawn without a bar
    assert (tmp_path / "kl.png").stat().st_size > 5_000



def test_the_split_puts_every_class_on_one_side(bench):
    """Tuning and confirmation (docs/benchmarks.md): each bench class is on exactly one side, so a class
    added later cannot be tuned on by being left out of both."""
    assert not set(bench.TUNING) & set(bench.CONFIRMATION)
    assert set(bench.TUNING) | set(bench.CONFIRMATION) == set(bench.CLASSES)


def test_windows_kl_is_the_same_per_window_whatever_the_chunk(bench, monkeypatch):
    """The quality pass holds one chunk of log-probs per checkpoint (a real vocabulary's whole set would
    not fit); the per-window KL is the whole-set computation's, bit for bit."""
    def fake_log_probs(folder, ids, chunk=16):  # a deterministic "model" per folder
        g = torch.Generator().manual_seed(len(str(folder)))
        table = torch.randn(50, 7, generator=g)
        return table[ids].log_softmax(-1)

    monkeypatch.setattr(bench.bc, "log_probs", fake_log_probs)
    ids = torch.randint(0, 50, (10, 5), generator=torch.Generator().manual_seed(1))
    got = bench.windows_kl("ref", {"a": "model-a", "bb": "model-bb"}, ids, chunk=3)
    for k, f in {"a": "model-a", "bb": "model-bb"}.items():
        want = bench.window_kl(fake_log_probs("ref", ids), fake_log_probs(f, ids))
        assert got[k].shape == (10,) and torch.equal(got[k], want)
