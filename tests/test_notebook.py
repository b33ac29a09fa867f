"""docs/notebook.ipynb runs top to bottom in a real Jupyter kernel and shows its results as tables.

The kernel is this interpreter (a kernel spec written to a temp dir, so whatever `python3` kernel
the machine has registered is not used) and runs in a temp working directory, where the notebook
writes out/glm. Skipped only when the kernel cannot start; a cell that raises fails the test.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat not installed: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="nbclient not installed: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="ipykernel not installed: pip install -e '.[test]'")
psutil = pytest.importorskip("psutil", reason="psutil not installed (ipykernel brings it): pip install -e '.[test]'")

NOTEBOOK = Path(__file__).resolve().parents[1] / "docs" / "notebook.ipynb"


def test_api_names_stay_functions_after_their_modules_are_imported():
    """`qk.plan(...)` twice in one session (rerunning a cell) must work: a lazy API name that equals
    its submodule's name is replaced by the module when the submodule is first imported."""
    import quantkit

    for name, (module, _) in quantkit._API.items():
        importlib.import_module(module)
        assert not isinstance(getattr(quantkit, name), type(quantkit)), f"qk.{name} is the module {module}"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    for c in code:
        assert c.outputs == [] and c.execution_count is None, f"clear the outputs of: {c.source.splitlines()[0]}"
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert any("import quantkit as qk" in c.source for c in code)


def _tagged(nb, tag: str):
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"one cell tagged {tag!r} expected"
    return cells[0]


def _data(cell, mime: str, output_type: str | None = None) -> list[str]:
    return [o["data"][mime] for o in cell.outputs
            if mime in o.get("data", {}) and (output_type is None or o["output_type"] == output_type)]


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    tmp = tmp_path_factory.mktemp("notebook")
    kernels = tmp / "kernels"
    write_kernel_spec(kernels / "quantkit-test")  # argv: this interpreter -m ipykernel_launcher
    km = KernelManager(kernel_name="quantkit-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))
    work = tmp / "work"
    work.mkdir()
    env = dict(os.environ)
    # One thread: the tiny model's ops are too small to gain from more, and OpenMP threads spinning
    # beside other test processes cost several times the work itself.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    env.setdefault("MPLBACKEND", "Agg")
    try:
        km.start_kernel(cwd=str(work), env=env)
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=90)
        kc.stop_channels()
    except Exception as e:  # noqa: BLE001 - any failure to start is "no kernel here"
        if km.has_kernel:
            km.shutdown_kernel(now=True)
        pytest.skip(f"a Jupyter kernel (ipykernel on {sys.executable}) could not start: {e!r}")

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, km=km, timeout=120, allow_errors=False,
                                     resources={"metadata": {"path": str(work)}})
    kernel = psutil.Process(km.provisioner.pid)
    t0 = time.time()
    try:
        client.execute()
        cpu = kernel.cpu_times()
    finally:
        km.shutdown_kernel(now=True)
    return nb, work, time.time() - t0, cpu.user + cpu.system + cpu.children_user + cpu.children_system


def test_notebook_runs(executed):
    nb, work, seconds, cpu_seconds = executed
    for c in nb.cells:
        if c.cell_type == "code":
            assert not [o for o in c.outputs if o["output_type"] == "error"], c.source
    assert (work / "out/glm/prefill/config.json").is_file() and (work / "out/glm/decode/config.json").is_file()
    assert (work / "out/glm/validation.png").is_file()
    # The notebook's own cost, in the kernel's CPU seconds (one thread: OMP_NUM_THREADS=1 above, so on a
    # quiet machine the same as its wall time): a wall-clock bound failed whenever other jobs shared the
    # cores, with the notebook unchanged. The wall time is reported, and bounded by nbclient's timeout.
    print(f"notebook: {cpu_seconds:.1f} CPU seconds, {seconds:.1f}s wall")
    assert cpu_seconds < 120, (f"the notebook took {cpu_seconds:.0f} CPU seconds ({seconds:.0f}s wall); "
                               "keep it under two minutes")


def test_results_display_as_tables(executed):
    nb, *_ = executed
    plan = _data(_tagged(nb, "plan"), "text/html", "execute_result")
    assert plan and "<table" in plan[0] and "checkpoints" in plan[0]
    for tag in ("inspect", "inspect-decode"):
        html = _data(_tagged(nb, tag), "text/html", "execute_result")
        assert html and "<table" in html[0] and "routed_expert" in html[0], tag
    convert = _data(_tagged(nb, "convert"), "text/html", "execute_result")
    assert convert and "quantkit convert" in convert[0] and "int4-g128" in convert[0]
    validate = _data(_tagged(nb, "validate"), "text/html", "execute_result")
    assert validate and "quantkit validate" in validate[0] and "PASSED" in validate[0]
    png = _data(_tagged(nb, "figure"), "image/png")
    assert png and len(png[0]) > 1000
    for tag in ("logits", "greedy"):
        assert "<table" in _data(_tagged(nb, tag), "text/html", "execute_result")[0], tag
    assert "decode (INT4)" in _data(_tagged(nb, "logits"), "text/html", "execute_result")[0]


def test_progress_is_a_live_widget_in_jupyter(executed):
    """rich draws progress in Jupyter through an ipywidgets Output; without ipywidgets it draws nothing."""
    pytest.importorskip("ipywidgets", reason="ipywidgets not installed: no live progress in Jupyter")
    nb, *_ = executed
    for tag in ("convert", "validate"):
        assert _data(_tagged(nb, tag), "application/vnd.jupyter.widget-view+json"), tag
