"""Device correctness without a device: the per-layer kernels run on fake accelerator tensors.

Why. Every tensor must be created on the device of the data it meets. A constant built on the
CPU (`torch.arange(...)` without `device=`) and combined with a CUDA tensor works in every CPU
test and raises on the first GPU run; int4.pack had exactly that bug.

How. torch's `FakeTensorMode` runs each op for shapes, dtypes and devices only, with no data and
no kernels, and raises `FakeTensorDeviceMismatchError` when tensors on two devices meet (0-dim
CPU scalars excepted, as in real torch); a tensor made outside the mode raises too. With a
`ShapeEnv`, data-dependent sizes (nonzero, unique, bincount) become symbolic, so routing runs,
and `.item()` gives a symbolic number. `test_harness_catches_a_cpu_constant` proves the harness
fails on the old int4.pack line.

The device. With a CUDA build of torch (with or without a GPU) the fake tensors are on `cuda:0`.
A CPU-only build can't index a fake CUDA tensor: the Python bindings of indexing, `.contiguous()`,
`.to()` and `.nonzero()` take a CUDA device guard, which a CPU build lacks (FakeTensorMode
installs a no-op guard only in CUDA builds without a GPU; torch 2.13). There the stand-in is
`lazy:0`, a non-CPU device whose guard every CPU build registers and which FakeTensorMode
treats like any accelerator. (`meta` is not like an accelerator: `torch.tensor(c, device="meta")`
inside the mode makes a real meta tensor, so valid code would fail.) The property tested is the
same on both: no CPU tensor meets one on the device.

What runs here, on the device:
  formats.int4 pack / unpack / dequantize / store; formats.fp8 quantize / dequantize;
  gptq: quantize_rtn, gptq (static and dynamic groups, actorder), hessian_from_inputs;
  awq: the smoothing search, the clip search, the fold, clipped quantization;
  quant.methods.quantize_experts with every registered method (starved experts included);
  calibrate.attention_pass through the activation store over every layer (DSA indexer, IndexShare);
  reference: Context.build, every layer's attention (MLA, DSA indexer with both tie rules,
  incremental decode with caches), dense decoder layers, route, Routing.tokens_of / counts,
  expert, the shared expert, and the MoE's index_add_.

What is left, because it needs values on the host, which a fake run does not have:
  - moe.moe's expert loop, `torch.unique(topk_idx).tolist()`: the test runs each of its
    parts (above), with the loop over all experts instead.
  - calibrate.gptq_experts (the streamed Hessians select each micro-batch's routed rows with
    nonzero: a data-dependent shape; tests/quant/methods/test_gptq.py holds it equal to the whole-layer
    quantize_experts run here), calibrate.convert_experts and convert(), forward.step
    (forward.run, validation): they read checkpoint
    bytes (and convert writes shards), which fake tensors do not have. Their device steps are
    `.to(dev)` after each CPU read, and safetensors' own move to the CPU when writing.
  - gptq's HessianError branch: it runs only after torch has raised on a failed Cholesky
    factorization, which a fake run never does (tests/quant/test_gptq.py covers it on the CPU).
  - the embedding lookup (forward.embed, convert) runs on the CPU on purpose, as do the rope tables
    (ops.rope_tables); both are moved to the device once.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from conftest import small_config
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from quantkit.formats import fp8, int4
from quantkit.model import moe, reference
from quantkit.model.arch import arch_from_config
from quantkit.quant import awq, gptq
from quantkit.quant.methods import METHODS, quantize_experts
from quantkit.recipe import load_recipe
from quantkit.synthetic.tiny import init_weights

DEVICE = torch.device("cuda:0" if torch.backends.cuda.is_built() else "lazy:0")


@contextmanager
def on_fake_device():
    """Everything inside runs on fake tensors; a device mix raises FakeTensorDeviceMismatchError."""
    with FakeTensorMode(shape_env=ShapeEnv()), torch.no_grad():
        yield


def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fake tensor on DEVICE (call inside `on_fake_device`)."""
    return torch.empty(shape, dtype=dtype, device=DEVICE)


def assert_on_device(*tensors) -> None:
    for t in tensors:
        assert t.device == DEVICE, f"result on {t.device}, inputs on {DEVICE}"


# ---- the harness can fail --------------------------------------------------------------------
def _pack_with_cpu_shifts(q: torch.Tensor) -> torch.Tensor:
    """The old int4.pack's inner step: the shift table built on the CPU."""
    u = (q.to(torch.int64) + 8).view(q.shape[0], -1, 8)  # (rows, words, 8)
    return (u << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)


def test_harness_catches_a_cpu_constant():
    with on_fake_device():
        q = empty(4, 16, dtype=torch.int8)
        with pytest.raises(FakeTensorDeviceMismatchError):
            _pack_with_cpu_shifts(q)
        assert_on_device(int4.pack(q))  # the fixed one


def test_harness_allows_what_real_torch_allows():
    """0-dim CPU tensors combine with device tensors in real torch; the harness must not flag them."""
    with on_fake_device():
        x = empty(4, 8)
        assert_on_device(x * torch.tensor(2.0))


# ---- formats ---------------------------------------------------------------------------------
def test_int4_on_device():
    with on_fake_device():
        q, scale = empty(16, 70, dtype=torch.int8), empty(16, 2, dtype=torch.bfloat16)  # 70: padded words
        packed = int4.pack(q)
        assert_on_device(packed, int4.unpack(packed, (16, 70)))
        assert_on_device(int4.pack(q, dim=0), int4.unpack(int4.pack(q, dim=0), (16, 70), dim=0))
        q64 = empty(16, 64, dtype=torch.int8)
        stored = int4.store(q64, scale)
        assert_on_device(*stored.values())
        zp = int4.pack(empty(16, 2, dtype=torch.int8), dim=0)
        assert_on_device(int4.dequantize(stored["weight_packed"], scale, (16, 64)),
                         int4.dequantize(stored["weight_packed"], scale, (16, 64), zero_point=zp))


def test_fp8_on_device():
    with on_fake_device():
        q, s = fp8.quantize(empty(200, 300, dtype=torch.bfloat16))  # partial edge blocks
        assert_on_device(q, s, fp8.dequantize(q, s))


# ---- quantizers ------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"actorder": True}, {"static_groups": False}], ids=["static", "actorder", "dynamic"])
def test_gptq_on_device(options):
    with on_fake_device():
        W, X = empty(3, 16, 128), empty(50, 128)
        H = gptq.hessian_from_inputs(X).expand(3, -1, -1)
        r = gptq.gptq(W, H, 32, block_size=64, **options)
        assert_on_device(r.q, r.scale, r.loss, r.dequantize())
        assert_on_device(gptq.hessian_from_inputs(empty(0, 128)))  # an expert with no tokens
        r = gptq.quantize_rtn(W, 32)
        assert_on_device(r.q, r.scale)


def test_awq_search_on_device():
    with on_fake_device():
        down, z = empty(3, 64, 128), empty(40, 128)
        z_mean = awq.activation_means(z).expand(3, -1)
        H = gptq.hessian_from_inputs(z).expand(3, -1, -1)
        s, alpha, err = awq.awq_smooth_scales(down, z_mean, H, 32, grid=4)
        up, down_s = awq.fold_up_down(empty(3, 128, 64), down, s)
        ratio = awq.auto_clip(down_s, H, 32, grid=4)
        r = awq.quantize_clipped(down_s, 32, ratio)
        assert_on_device(s, alpha, err, up, down_s, ratio, r.q, r.scale, awq.activation_means(empty(0, 128)))


# ---- the layer loop --------------------------------------------------------------------------
def _fake_layer(arch, weights: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s weights (names relative to the layer) as fake tensors on DEVICE."""
    p = arch.layer_prefix(layer)
    return {k[len(p):]: torch.empty(v.shape, dtype=v.dtype, device=DEVICE) for k, v in weights.items() if k.startswith(p)}


@pytest.fixture(scope="module", params=["deepseek_v3", "glm"])
def model(request):
    arch = arch_from_config(small_config(request.param))
    return arch, init_weights(arch, torch.Generator().manual_seed(0))


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))  # every registered method
def test_quantize_experts_on_device(model, method):
    arch, weights = model
    recipe = load_recipe("tiny-glm-5.2")
    experts = [0, 1, 2, 3]
    with on_fake_device():
        w = _fake_layer(arch, weights, 1)
        x = empty(64, arch.hidden_size)
        # odd experts get their own tokens, even ones too few (the all_tokens fallback)
        n = {e: recipe.gptq.min_tokens + 8 if e % 2 else 3 for e in experts}
        tokens = {e: torch.randint(0, 64, (n[e],), device=DEVICE) for e in experts}
        quantized, records = quantize_experts(x, w, tokens, experts, recipe, 32, method, 1)
    assert sorted(quantized) == experts and len(records) == len(experts)
    assert_on_device(*(t for q in quantized.values() for r in q.values() for t in (r.q, r.scale)))


@pytest.mark.parametrize("ties", ["earliest", "topk"])
def test_reference_layers_on_device(model, ties):
    """Every layer's attention in order (IndexShare layers reuse the selection), the dense layers
    whole, and the MoE's pieces; a prompt, then one decode step against the caches."""
    arch, weights = model
    B, T = 2, 12  # T > index_topk (6): the DSA selection really cuts keys
    with on_fake_device():
        caches = [reference.LayerCache() for _ in range(arch.num_hidden_layers)]
        for start, n in ((0, T), (T, 1)):
            ctx = reference.Context.build(arch, n, DEVICE, torch.float32, start=start, caches=caches, dsa_ties=ties)
            assert_on_device(ctx.positions, ctx.cos, ctx.sin)
            h = empty(B, n, arch.hidden_size)
            for layer in range(arch.num_hidden_layers):
                w = _fake_layer(arch, weights, layer)
                if not arch.is_moe(layer):
                    out = reference.decoder_layer(h, w, ctx, layer)
                    assert_on_device(out.hidden, out.moe_input)
                    continue
                attn = reference.attention(h, w, ctx, layer)
                x = attn.reshape(-1, arch.hidden_size)  # (B*n, D)
                topk_idx, topk_weight = moe.route(x, w, arch)
                routing = moe.Routing(x, topk_idx, topk_weight)
                out = torch.zeros_like(x)
                for e in range(arch.n_routed_experts):  # moe() loops over the experts hit (a host read)
                    tok, wt = routing.tokens_of(e)
                    out.index_add_(0, tok, moe.expert(x[tok], w, e) * wt[:, None])
                shared = moe.shared_expert(x, w, arch)
                assert_on_device(attn, topk_idx, topk_weight, routing.counts(arch.n_routed_experts), out + shared)
            assert_on_device(*(t for c in caches for t in (c.latent, c.k_rot, c.index_k) if t is not None))


def test_calibration_attention_on_device(model):
    """convert's attention pass through the activation store (micro-batched, DSA selections carried
    between layers) and the routing it keeps."""
    from quantkit.conversion.activations import ActivationStore
    from quantkit.conversion.layerpass import attention_pass
    from quantkit.planner.cost import StorePlan

    arch, weights = model
    with on_fake_device():
        ctx = reference.Context.build(arch, 12, DEVICE, torch.float32)
        store = ActivationStore(10, 12, arch.hidden_size, StorePlan(micro_batch=8), DEVICE)  # two micro-batches
        topks = [None, None]
        for layer in range(arch.num_hidden_layers):
            w = _fake_layer(arch, weights, layer)
            routing = attention_pass(store, w, ctx, layer, topks, arch.is_moe(layer))
            assert_on_device(store.h.data, *(t for t in topks if t is not None))
            if arch.is_moe(layer):
                assert_on_device(store.x.data, routing.idx, routing.weight, routing.counts)