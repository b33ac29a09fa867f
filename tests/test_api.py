"""The notebook API: `import quantkit as qk` names stay the functions, however often they are used."""

import importlib

import quantkit as qk


def test_api_names_are_callables_after_their_modules_load():
    for name in ("inspect", "plan", "convert", "validate", "logits", "pull"):
        module, attr = qk._API[name]
        importlib.import_module(module)  # importing a submodule binds it on the package...
        assert callable(getattr(qk, name)), name  # ...which must not shadow the API function
        assert getattr(qk, name) is getattr(importlib.import_module(module), attr)


def test_repeated_use(tiny_glm):
    a, b = qk.inspect("tiny:glm-5.2"), qk.inspect("tiny:glm-5.2")
    assert a.to_json() == b.to_json()
    assert "<table>" in a._repr_html_()
    assert "glm-5.2" in qk.plan("glm-5.2")._repr_html_()


def test_convert_and_validate_take_the_same_keyword_names():
    import inspect as pyinspect

    conv, val = (set(pyinspect.signature(f).parameters) for f in (qk.convert, qk.validate))
    for name in ("gate", "device", "progress", "max_host_memory", "max_gpu_memory"):
        assert name in conv and name in val, name


def test_dir_lists_the_api_and_nothing_else():
    names = dir(qk)
    assert "annotations" not in names and "importlib" not in names
    public = [n for n in names if not n.startswith("_")]
    assert public == sorted(qk.__all__)
    for name in ("ConvertResult", "ValidationResult", "RowMetrics", "VerifyResult"):
        assert name in qk.__all__ and isinstance(getattr(qk, name), type), name


def test_results_have_typed_attributes_for_the_headline_numbers(tmp_path):
    metrics = {"kl": 0.01, "top1": 0.98, "ppl": 5.1, "ppl_delta": 0.003, "layer_rel_err": 0.02, "greedy_agree": 1.0}
    data = {"rows": {"decode": {"metrics": metrics}, "prefill": {"metrics": metrics | {"kl": 0.0}}}, "passed": True,
            "gates": [{"gate": "kl_max", "row": "decode", "passed": True}, {"gate": "kl_max", "row": "prefill", "passed": None}]}
    val = qk.ValidationResult(tmp_path, data, {})
    assert isinstance(val.decode, qk.RowMetrics) and val.decode.kl == 0.01 and val.prefill.kl == 0.0
    assert val.rows["decode"].top1 == 0.98 and val.cross_phase is None
    assert (val.gates_passed, val.gates_checked) == (1, 1)
    report = {"method": "gptq", "seconds": 3.5, "experts_summary": {"total": 8, "gptq": 6, "rtn": 2},
              "outputs": {"prefill": {"bytes": 10}, "decode": {"bytes": 4}}}
    res = qk.ConvertResult(tmp_path, tmp_path / "prefill", tmp_path / "decode", report)
    assert (res.method, res.prefill_bytes, res.decode_bytes, res.seconds) == ("gptq", 10, 4, 3.5)
    assert res.experts == {"total": 8, "gptq": 6, "rtn": 2}


def test_each_planning_question_has_one_api_name_and_one_command_row():
    """inspect, plan, plan --convert and plan --tasks: each answered by one function in quantkit.planner, named in
    the API, and its command listed in the README's table."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for name, command in (("inspect", "quantkit inspect MODEL"), ("plan", "quantkit plan MODEL`"),
                          ("plan_convert", "quantkit plan MODEL --convert"), ("plan_tasks", "quantkit plan MODEL --tasks")):
        module, _ = qk._API[name]
        assert module.startswith("quantkit.planner."), name
        assert callable(getattr(qk, name)) and f"| `{command}" in readme, name
    cost = qk.plan_convert("tiny:glm-5.2", gpu="cpu", max_host_memory="4GB")
    assert cost.peak_host > 0 and cost.fits and cost.to_json()["store"]["backing"] in ("memory", "disk")


def test_validate_applies_the_gate_it_is_given_by_converts_keyword(tmp_path, tiny_glm):
    """`qk.validate(dir, gate=...)` failed (it took `gates=` only); the gate given is the one checked."""
    out = qk.convert("tiny:glm-5.2", tmp_path / "glm", method="rtn", validate=False, progress=False).out
    small = dict(num_samples=1, seq_len=8, gen_tokens=2, device="cpu", progress=False, long_context=0, write=False)
    res = qk.validate(out, gate={"kl_max": 1e-30}, **small)
    kl = [g for g in res.data["gates"] if g["gate"] == "kl_max" and g["row"] == "decode"]
    assert kl and kl[0]["bound"] == 1e-30 and kl[0]["passed"] is False and not res.passed
    assert [g["gate"] for g in res.data["gates"]] == ["kl_max"] * len(res.data["gates"])  # the recipe's are replaced
