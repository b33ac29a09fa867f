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
