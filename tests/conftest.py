"""Shared fixtures: the embedded tiny models (built once per machine into the quantkit cache) and
small random checkpoints of any family and storage format, cheap enough to build per test."""

from __future__ import annotations

import copy
import os
from pathlib import Path

# OpenMP threads that wait for work sleep instead of spinning (read when torch loads its OpenMP runtime,
# so before the import; inherited by every worker and subprocess the tests start). Spinning threads
# beside other jobs on the same cores made the in-process converts several times slower under load
# (a small GPTQ convert: 3.6-26 s against 1.0-1.2 s at load average 6-8 on 2 cores); the bytes are
# the same (only how an idle thread waits changes, not how work is split).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One thread per test process, and per subprocess it starts (OMP_NUM_THREADS is read when torch loads):
# the test command runs two workers on two cores, so two threads each oversubscribed the machine, and a
# CLI run inside a test took the machine's core count (2 on CI, more elsewhere) while the in-process code
# took 2. With 1 everywhere, a test's numbers do not change with the machine's core count, and an
# in-process result and a subprocess's are computed alike.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from quantkit.checkpoint.writer import CheckpointWriter
from quantkit.formats import fp8, int4
from quantkit.model.arch import arch_from_config
from quantkit.quant.gptq import quantize_rtn
from quantkit.synthetic.tiny import GLM, KIMI_TEXT, init_weights, tiny_path

# Float reductions (and so INT4 rounding of a few weights) depend on the thread count: fix it (above).
torch.set_num_threads(1)


# Files that run for minutes (the real-width conversions), started before every other file.
LONGEST_FILES = ("synthetic/test_realshape.py",)


def pytest_collection_modifyitems(config, items):
    """LONGEST_FILES first, then the other files that hold a test marked `slow`, then the rest, each
    group in collection order (a stable sort: no test moves within its file). The test command runs
    whole files on two workers (`-n 2 --dist loadfile --no-loadscope-reorder`): a file of minutes
    started last would leave the other worker idle at the end. Without --no-loadscope-reorder,
    pytest-xdist 3.8 reorders the files by their number of tests, which puts the real-shape file
    (three tests, ten minutes) last whatever this order says."""
    here = Path(__file__).parent
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first = {here / f for f in LONGEST_FILES}
    items.sort(key=lambda item: (item.path not in first, item.path not in slow_files))


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test (files that read only local data use it for every
    test: `pytestmark = pytest.mark.usefixtures("no_network")`)."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("test tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="session")
def tiny_kimi() -> Path:
    return tiny_path("kimi-k2.6")


@pytest.fixture(scope="session")
def tiny_glm() -> Path:
    return tiny_path("glm-5.2")


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return tiny_path("qwen3-moe")


def small_config(family: str, **overrides) -> dict:
    """A config.json smaller than the tiny models (2-3 layers), for random-weight checkpoints."""
    if family == "glm":
        cfg = copy.deepcopy(GLM)
        cfg.update(num_hidden_layers=3, n_routed_experts=8, index_topk=6)
    else:
        cfg = copy.deepcopy(KIMI_TEXT)
        cfg.update(model_type="deepseek_v3", num_hidden_layers=3, n_routed_experts=8, n_group=4, topk_group=2,
                   first_k_dense_replace=1, num_nextn_predict_layers=0,
                   rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    cfg.update(overrides)
    return cfg


def write_random(folder: Path, config: dict, *, experts: str = "bf16", linears: str = "bf16", seed: int = 0,
                 digits: int = 5, tensors: dict | None = None) -> tuple[Path, dict[str, torch.Tensor]]:
    """Random weights saved with routed experts and other Linears in `bf16`, `fp32`, `fp8` or `int4`.

    Returns the folder and the fp32 weights as generated (before storage rounding).
    """
    arch = arch_from_config(config)
    t = tensors if tensors is not None else init_weights(arch, torch.Generator().manual_seed(seed))
    w = CheckpointWriter(folder, digits=digits)
    for name, x in sorted(t.items()):
        is_linear = name.endswith("proj.weight") or name.endswith(("wq_b.weight", "wk.weight"))
        keep = name.endswith(("mlp.gate.weight", "weights_proj.weight", "eh_proj.weight"))
        fmt = experts if ".mlp.experts." in name else (linears if is_linear and not keep else "bf16")
        if name.endswith("e_score_correction_bias"):
            fmt = "fp32"
        if fmt == "int4":
            qw = quantize_rtn(x, 32)
            for suffix, s in int4.store(qw.q, qw.scale).items():
                w.add(name[: -len("weight")] + suffix, s)
        elif fmt == "fp8":
            q, s = fp8.quantize(x)
            w.add(name, q)
            w.add(name[: -len("weight")] + "weight_scale_inv", s)
        else:
            w.add(name, x.to(torch.float32 if fmt == "fp32" else torch.bfloat16))
    return w.finish(config), t


def starve_expert(src: Path, dst: Path, layer: int, expert: int) -> None:
    """Copy checkpoint `src` to `dst` with one expert's correction bias so low the router never picks it."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(dst / shard))
    tensors[name][expert] = -100.0
    with safe_open(str(dst / shard), framework="pt") as f:
        meta = f.metadata()
    save_file(tensors, str(dst / shard), metadata=meta)
