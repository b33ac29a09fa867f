"""The quantization methods: one module each, registered by decorator (quantkit.quant.methods.registry:
the interface, METHODS and `method_for`, the one place a method's name is read).

Importing the package registers the shipped methods, in the order help texts and reports list
them: gptq, awq, rtn, rtn-clip. A method added elsewhere registers itself the same way
(`@register` on its class) once its module is imported; tests/quant/methods/test_registry.py
converts a tiny model with one registered at test time.
"""

from quantkit.quant.methods.registry import (
    METHODS,
    Inputs,
    Method,
    ProbeCost,
    Settings,
    method_for,
    quantize_experts,
    register,
    unknown_method,
)

# isort: off
# registration, in the order help texts and reports list the methods
from quantkit.quant.methods import gptq  # noqa: F401
from quantkit.quant.methods import awq  # noqa: F401
from quantkit.quant.methods import rtn  # noqa: F401
from quantkit.quant.methods import rtn_clip  # noqa: F401
# isort: on

__all__ = ["Inputs", "Method", "METHODS", "ProbeCost", "Settings", "method_for", "register", "unknown_method",
           "quantize_experts"]
