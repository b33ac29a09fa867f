"""Runs a serving engine's own quantization-config code on CPU, in a child process.

`python -m quantkit.serving.harness` reads one JSON request on stdin and prints one JSON answer:

    request  {"engine": "sglang"|"vllm", "src": <folder of the release's .py files>,
              "jobs": [{"quantization_config": {...}, "packed_modules_mapping": {...},
                        "create_weights": bool, "modules": [{"name", "class", "kind", "create"}]}]}
    answer   {"jobs": [{"modules": [{"name", "method", "scheme", "block", "error", "params"}],
                        "weight_block_size", "wint4_linear_config"} or {"fatal": reason}],
              "stubbed": [the engine modules that were stubs]}

Why a child process: the engines cannot be installed beside our torch (they pin their own, and
need CUDA kernels), so the modules that turn a config into schemes are loaded from the pinned
release's files by path, and every other engine module they import is a stub. Stubs and the
simulated GPU must not leak into the caller, hence the process boundary.

What runs for real (the engine's code, unmodified):
  - SGLang: `srt/layers/quantization/compressed_tensors/` (config parsing, `find_matched_target`,
    `should_ignore_layer`, `get_linear_scheme`, `get_moe_scheme`, the scheme classes'
    constructors and `create_weights`), `srt/layers/quantization/fp8.py` (`Fp8Config.from_config`,
    `get_quant_method`, `Fp8LinearMethod` / `Fp8MoEMethod.create_weights`),
    `srt/layers/quantization/utils.py` (`is_layer_skipped`), `srt/layers/parameter.py`,
    `srt/layers/moe/utils.py` (`get_moe_weight_sizes`), `srt/models/deepseek_common/utils.py`
    (`is_wint4afp8_or_wint4a16_config`, the shared-experts fusion gate's quantization test).
  - vLLM: `model_executor/layers/quantization/compressed_tensors/` (config parsing, matching,
    `get_scheme`, `CompressedTensorsMoEMethod.get_moe_method`, scheme and MoE-method constructors
    and `create_weights`), `model_executor/layers/quantization/fp8.py` (`Fp8Config`,
    `Fp8LinearMethod` / `Fp8MoEMethod`), `.../quantization/utils/{quant_utils,config_utils,fp8_utils}.py`,
    `model_executor/parameter.py`.

What is stubbed (and why): every other engine module is a `_StubModule` whose attributes are
inert classes (kernels, distributed state, loggers, model runner flags), and third-party kernel
packages this machine lacks (flashinfer, sgl_kernel, triton, ...) likewise. The base classes the
dispatch tests with `isinstance` (`LinearBase`, `FusedMoE` / `RoutedExperts`, `ParallelLMHead`) are
stubs too, and our stand-in layers derive from them under the engine's real class names. Explicit
stand-ins, where an inert value would take another code path:
  - the device: an sm90 GPU (H100/H200), as `torch.cuda.get_device_capability` inside engine
    modules, vLLM's `current_platform`, SGLang's `is_cuda()` (`is_hip`/`is_npu`/`is_xpu` false);
  - TP 1: `get_tensor_model_parallel_world_size() == 1`, SGLang `layer.tp_group = None`; a module
    request with "tp" > 1 and per-rank create sizes (plus "input_size_full" / "output_size_full")
    builds one rank's shard instead (vLLM `layer.tp_size`, SGLang `layer.tp_group.world_size`);
  - the MoE layer's config: gated SwiGLU, no bias (vLLM `FusedMoEConfig.is_act_and_mul`, SGLang
    `MoeRunnerConfig.is_gated`), and vLLM's `FusedMoEMethodBase.__init__` keeping it as `self.moe`
    (fused_moe/fused_moe_method_base.py);
  - vLLM's kernel-backend oracles, which pick a GPU kernel, not a format:
    `select_wna16_moe_backend` (fused_moe/oracle/int_wna16.py) -> Marlin,
    `select_fp8_moe_backend` / `resolve_fp8_moe_weight_block_shape` (fused_moe/oracle/fp8.py) ->
    the checkpoint's block shape at TP 1;
  - `set_weight_attrs` (SGLang srt/utils/common.py, vLLM model_executor/utils.py): the setattr loop
    it is upstream.
`create_weights` runs with `params_dtype=bfloat16` (the models' `torch_dtype`) on the meta device.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import traceback
import types
from pathlib import Path

# Engine modules executed from the release's files (prefix match on the dotted name).
REAL = {
    "sglang": (
        "sglang.srt.layers.quantization.compressed_tensors",
        "sglang.srt.layers.quantization.fp8",
        "sglang.srt.layers.quantization.utils",
        "sglang.srt.layers.quantization.base_config",
        "sglang.srt.models.deepseek_common.utils",
        "sglang.srt.layers.parameter",
        "sglang.srt.layers.moe.utils",
    ),
    "vllm": (
        "vllm.model_executor.layers.quantization.compressed_tensors",
        "vllm.model_executor.layers.quantization.fp8",
        "vllm.model_executor.layers.quantization.base_config",
        "vllm.model_executor.layers.quantization.utils.quant_utils",
        "vllm.model_executor.layers.quantization.utils.config_utils",
        "vllm.model_executor.parameter",
        "vllm.model_executor.layers.quantization.utils.fp8_utils",
    ),
}
ROOTS = ("sglang", "vllm")
SM = (9, 0)  # the simulated GPU: Hopper (H100/H200)


# ---- stubs --------------------------------------------------------------------------------------
class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Value()

    def __bool__(cls):
        return True


class _Stub(metaclass=_StubMeta):
    """An inert engine class: constructible with anything, subclassable, every attribute inert."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Value()


class _Value:
    """An inert value: callable, falsy, empty, usable in `X | None` annotations."""

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs and not isinstance(args[0], _Value):
            return args[0]  # used as a decorator: keep the decorated function
        return _Value()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Value()

    def __bool__(self):
        return False

    def __iter__(self):
        return iter(())

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __getitem__(self, item):
        return _Value()

    def __eq__(self, other):
        return other is self

    def __hash__(self):
        return id(self)


class _MoeConfig(_Value):
    """vLLM's FusedMoEConfig for a DeepSeek MoE at TP 1: SwiGLU (gate and up fused), no bias."""

    is_act_and_mul = is_gated = True
    w13_num_shards = 2
    has_bias = False


STUBBED: set[str] = set()


class _StubModule(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []  # a package, so submodules resolve through us too
        self._classes: dict[str, type] = {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._classes:
            self._classes[name] = type(name, (_Stub,), {"__module__": self.__name__})
        return self._classes[name]


def _set_weight_attrs(weight, weight_attrs):
    for key, value in (weight_attrs or {}).items():
        setattr(weight, key, value)


class _Capability(tuple):
    def to_int(self) -> int:
        return self[0] * 10 + self[1]

    @property
    def major(self):
        return self[0]

    @property
    def minor(self):
        return self[1]


class _Platform(_Stub):
    """vLLM's `current_platform` on the simulated CUDA sm90 device."""

    def get_device_capability(self, device_id: int = 0):
        return _Capability(SM)

    def has_device_capability(self, capability, device_id: int = 0):
        cap = capability if isinstance(capability, int) else capability[0] * 10 + capability[1]
        return _Capability(SM).to_int() >= cap

    def is_cuda(self):
        return True

    def is_cuda_alike(self):
        return True

    device_type = "cuda"


def _fill_stub(mod: _StubModule) -> None:
    """Explicit values where an inert one would send the engine down another device's path."""
    name = mod.__name__
    if name in ("sglang.srt.utils", "sglang.srt.utils.common"):
        mod.is_cuda = lambda: True
        mod.is_cuda_alike = lambda: True
        for f in ("is_hip", "is_npu", "is_xpu", "is_cpu", "is_musa", "is_mps"):
            setattr(mod, f, lambda: False)
        mod.set_weight_attrs = _set_weight_attrs
        mod.get_device_capability = lambda *a, **k: SM
    if name in ("vllm.distributed", "sglang.srt.distributed", "vllm.distributed.parallel_state",
                "sglang.srt.distributed.parallel_state"):
        mod.get_tensor_model_parallel_world_size = lambda *a, **k: 1  # TP 1: whole tensors
        mod.get_tensor_model_parallel_rank = lambda *a, **k: 0
    if name == "vllm.model_executor.layers.fused_moe":
        # as upstream (fused_moe/fused_moe_method_base.py): the base keeps the layer's MoE config
        mod.FusedMoEMethodBase = type("FusedMoEMethodBase", (_Stub,), {
            "__module__": name, "__init__": lambda self, moe=None, *a, **k: setattr(self, "moe", moe)})
    if name == "vllm.platforms":
        mod.current_platform = _Platform()
    if name == "vllm.model_executor.layers.fused_moe.oracle.int_wna16":
        # the MoE kernel backend is the GPU's choice, not the checkpoint's (select_wna16_moe_backend)
        mod.select_wna16_moe_backend = lambda *a, **k: ("marlin", None)
    if name == "vllm.model_executor.layers.fused_moe.oracle.fp8":
        # TP 1 keeps the checkpoint's block shape (resolve_fp8_moe_weight_block_shape); the kernel
        # backend is the GPU's choice (select_fp8_moe_backend)
        mod.resolve_fp8_moe_weight_block_shape = lambda config, block, *a, **k: (block, None)
        mod.select_fp8_moe_backend = lambda *a, **k: ("triton", None)
    if name == "vllm.model_executor.utils":
        mod.set_weight_attrs = _set_weight_attrs


class _SimulatedCuda:
    def __init__(self, cuda):
        self._cuda = cuda

    def get_device_capability(self, *args, **kwargs):
        return SM

    def is_available(self):
        return True

    def __getattr__(self, name):
        return getattr(self._cuda, name)


class _TorchOnGpu:
    """What an engine module sees as `torch`: the real one, but `torch.cuda` reports an sm90 GPU."""

    def __init__(self, torch):
        self._torch = torch
        self.cuda = _SimulatedCuda(torch.cuda)

    def __getattr__(self, name):
        return getattr(self._torch, name)


class EngineFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on the path: the engine's modules in REAL[engine] load from the pinned release's files,
    every other module of the engine becomes an inert stub. quantkit.serving.cliparse subclasses it
    with the argument parsers' files as the real ones (`is_real`)."""

    def __init__(self, engine: str, src: Path):
        self.engine, self.src = engine, src
        self.real = REAL[engine]

    def is_real(self, name: str) -> bool:
        return any(name == r or name.startswith(r + ".") for r in self.real)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in ROOTS:
            return None
        if self.is_real(name):
            rel = Path(*name.split("."))
            for cand, pkg in ((self.src / rel / "__init__.py", True), (self.src / rel.with_suffix(".py"), False)):
                if cand.is_file():
                    spec = importlib.util.spec_from_file_location(
                        name, cand, submodule_search_locations=[str(cand.parent)] if pkg else None)
                    spec.loader = _RealLoader(spec.loader)
                    return spec
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        STUBBED.add(spec.name)
        mod = _StubModule(spec.name)
        _fill_stub(mod)
        return mod

    def exec_module(self, module):
        pass


class MissingFinder(importlib.abc.MetaPathFinder):
    """Last on the path: third-party modules the engine imports but this machine lacks (kernels:
    flashinfer, sgl_kernel, triton, deep_gemm, ...) become stubs while engine code loads."""

    def __init__(self, stubs: EngineFinder):
        self.stubs = stubs

    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if "." in name and not isinstance(sys.modules.get(top), _StubModule):
            return None  # a missing submodule of a real package is that package's business
        return importlib.machinery.ModuleSpec(name, self.stubs, is_package=True)


class _RealLoader(importlib.abc.Loader):
    """Executes the engine's file as is, then points its `torch` at the simulated GPU."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.inner.exec_module(module)
        if "torch" in vars(module):
            module.torch = _TorchOnGpu(vars(module)["torch"])


# ---- layers -------------------------------------------------------------------------------------
def _layer(engine: str, cls_name: str, attrs: dict):
    """A stand-in layer: an instance of the engine's (stubbed) base class, named as the engine
    names its real class, so `isinstance` and class-name matching behave as in the engine."""
    import torch

    if engine == "sglang":
        base_mod, base = {
            "moe": ("sglang.srt.layers.moe.fused_moe_triton", "FusedMoE"),
            "lm_head": ("sglang.srt.layers.vocab_parallel_embedding", "ParallelLMHead"),
        }.get(attrs["kind"], ("sglang.srt.layers.linear", "LinearBase"))
    else:
        base_mod, base = {
            "moe": ("vllm.model_executor.layers.fused_moe", "RoutedExperts"),
            "lm_head": ("vllm.model_executor.layers.vocab_parallel_embedding", "ParallelLMHead"),
        }.get(attrs["kind"], ("vllm.model_executor.layers.linear", "LinearBase"))
    base_cls = getattr(importlib.import_module(base_mod), base)
    cls = type(cls_name, (torch.nn.Module, base_cls), {"__init__": torch.nn.Module.__init__})
    layer = cls()
    tp = int(attrs.get("tp") or 1)  # a rank's shard under tensor parallelism (quantkit.serving.layout's oracle)
    if tp > 1:
        layer.tp_size = tp  # vLLM validate_fp8_block_shape: getattr(layer, "tp_size", world size)
    layer.moe_tp_size = 1
    layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name = "gate_proj", "up_proj", "down_proj"
    layer.use_triton_kernels = layer.use_flashinfer_trtllm_moe = False
    layer.moe_config = _MoeConfig()  # vLLM's FusedMoEConfig
    layer.moe_runner_config = _MoeConfig()  # SGLang's MoeRunnerConfig (is_gated)
    layer.tp_group = types.SimpleNamespace(world_size=tp) if tp > 1 else None  # SGLang: None means TP 1
    return layer


def _params(layer) -> dict:
    return {n: {"dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape),
                "transposed": bool(getattr(p, "is_transposed", False))} for n, p in layer.named_parameters()}


def _describe(method, layer) -> tuple[str, str | None]:
    scheme = getattr(layer, "scheme", None)
    mname = type(method).__name__ if method is not None else "None"
    if isinstance(scheme, _Value) or isinstance(sys.modules.get(type(scheme).__module__), _StubModule):
        scheme = None  # an inert attribute, not a scheme the engine chose
    return mname, (type(scheme).__name__ if scheme is not None else None)


def _create(method, layer, m: dict) -> None:
    """Run the method's/scheme's `create_weights` for the module's real sizes (TP 1)."""
    import torch

    c = m.get("create")
    if not c:
        return
    target = getattr(layer, "scheme", None) or method
    with torch.device("meta"):  # shapes and dtypes only: a real Kimi MoE layer would allocate gigabytes
        _create_on(target, layer, m["kind"], c)


def _create_on(target, layer, kind: str, c: dict) -> None:
    import torch

    if kind == "moe":
        target.create_weights(layer, num_experts=c["num_experts"], hidden_size=c["hidden_size"],
                              intermediate_size_per_partition=c["intermediate_size"], params_dtype=torch.bfloat16,
                              weight_loader=_Value())
    else:
        # a rank's shard: the full sizes beside the per-rank ones (defaults: TP 1, the same)
        target.create_weights(layer=layer, input_size_per_partition=c["input_size"],
                              output_partition_sizes=c["output_sizes"],
                              input_size=c.get("input_size_full", c["input_size"]),
                              output_size=c.get("output_size_full", sum(c["output_sizes"])), params_dtype=torch.bfloat16,
                              weight_loader=_Value())


_CONFIG_CLASSES = {  # (engine, quant_method) -> (module, class) of the engine's quantization config
    ("sglang", "compressed-tensors"): ("sglang.srt.layers.quantization.compressed_tensors.compressed_tensors",
                                       "CompressedTensorsConfig"),
    ("sglang", "fp8"): ("sglang.srt.layers.quantization.fp8", "Fp8Config"),
    ("vllm", "compressed-tensors"): ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
                                     "CompressedTensorsConfig"),
    ("vllm", "fp8"): ("vllm.model_executor.layers.quantization.fp8", "Fp8Config"),
}


def _quant_config(engine: str, qc: dict, packed: dict):
    method = qc.get("quant_method")
    if (engine, method) not in _CONFIG_CLASSES:
        raise ValueError(f"quant_method {method!r}")
    module, name = _CONFIG_CLASSES[engine, method]
    cfg = getattr(importlib.import_module(module), name).from_config(dict(qc, packed_modules_mapping=packed))
    # what the engine's model class does after constructing it (SGLang: update_packed_modules_mapping;
    # vLLM: configure_quant_config)
    cfg.packed_modules_mapping = dict(packed)
    return cfg


def run(req: dict) -> dict:
    """Install the engine's modules, then answer each job (one checkpoint folder each)."""
    engine, src = req["engine"], Path(req["src"])
    import compressed_tensors  # noqa: F401  (the real ones, before any stub can exist)
    import torch  # noqa: F401

    finder = EngineFinder(engine, src)
    sys.meta_path.insert(0, finder)
    sys.meta_path.append(MissingFinder(finder))
    jobs = [_job(engine, job) for job in req["jobs"]]
    return {"jobs": jobs, "stubbed": sorted(STUBBED)}


def _job(engine: str, req: dict) -> dict:
    try:
        cfg = _quant_config(engine, req["quantization_config"], req.get("packed_modules_mapping", {}))
    except Exception as e:  # noqa: BLE001 - the engine refusing the config is the answer
        return {"fatal": f"{type(e).__name__}: {e}", "modules": []}
    out: dict = {"modules": []}
    for m in req["modules"]:
        row = {"name": m["name"], "method": None, "scheme": None, "block": None, "error": None, "params": None}
        layer = _layer(engine, m["class"], m)
        try:
            method = cfg.get_quant_method(layer, prefix=m["name"])
            row["method"], row["scheme"] = _describe(method, layer)
            wq = getattr(getattr(layer, "scheme", None), "weight_quant", None)
            if wq is not None and getattr(wq, "block_structure", None):
                row["block"] = list(wq.block_structure)
            if row["method"] in ("Fp8LinearMethod", "Fp8MoEMethod"):
                row["block"] = list(cfg.weight_block_size) if cfg.weight_block_size else None
            if req.get("create_weights") and row["method"] not in UNQUANTIZED:
                try:
                    _create(method, layer, m)
                    row["params"] = _params(layer)
                except Exception as e:  # noqa: BLE001 - reported per module, the caller decides
                    row["params_error"] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - an engine refusing a module is the answer we want
            row["error"] = f"{type(e).__name__}: {e}"
        out["modules"].append(row)
    if engine == "sglang":
        out["weight_block_size"] = getattr(cfg, "weight_block_size", None)
        from sglang.srt.models.deepseek_common.utils import (
            is_wint4afp8_or_wint4a16_config,
        )

        out["wint4_linear_config"] = bool(is_wint4afp8_or_wint4a16_config(cfg))
    return out


UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod", "None")


def main() -> None:
    req = json.loads(sys.stdin.read())
    try:
        ans = run(req)
    except Exception as e:  # noqa: BLE001 - the parent turns this into a refusal with the reason
        ans = {"fatal": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    sys.stdout.write(json.dumps(ans))
    sys.stdout.flush()
    os._exit(0)  # skip atexit hooks: stubbed modules confuse torch's exit-time reporting


if __name__ == "__main__":
    main()
