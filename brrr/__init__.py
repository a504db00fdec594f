"""brrr: fused GPU operators for PyTorch (and NumPy, CuPy, JAX: anything that speaks DLPack).

Elementwise work is memory-bound: every separate op reads its input from memory and writes its
output back. brrr runs whole chains of such ops as one pass over memory (operator fusion), and its
backward passes recompute cheap intermediates from the input instead of storing them
(rematerialisation). See README.md for the three regimes (compute, bandwidth, overhead).
"""

import sys

try:
    from . import _C
except ImportError:
    import importlib.machinery
    import os

    _here = os.path.dirname(os.path.abspath(__file__))
    # A source tree (setup.py beside the package) without a _C built for this Python: say so,
    # rather than Python's "partially initialized module (most likely due to a circular import)".
    if os.path.exists(os.path.join(_here, os.pardir, "setup.py")) and not any(
            os.path.exists(os.path.join(_here, "_C" + suffix)) for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        raise ImportError("brrr's C extension is not built in this source tree: pip install -e . or run from "
                          "elsewhere") from None
    raise
from . import _frameworks
from .chain import (
    Chain,
    chain,
    cos,
    exp,
    gelu,
    relu,
    sigmoid,
    silu,
    sin,
    tanh,
)
from .glu import bias_gelu, bias_silu, geglu, swiglu
from .dropout import bias_dropout_add
from .norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from .rotary import apply_rotary_pos_emb, rotary
from .softmax import log_softmax, softmax
from .xent import cross_entropy, linear_cross_entropy

__version__ = "0.1.0"


def cuda_available() -> bool:
    """True when CUDA kernels were compiled in and the runtime sees at least one GPU."""
    return _C.cuda_available()


def set_num_threads(n: int) -> int:
    """Threads of brrr's CPU kernels: n > 0, or 0 for the automatic count (torch.get_num_threads()
    for torch tensors, else OMP_NUM_THREADS or os.cpu_count()). BRRR_NUM_THREADS sets it at import.
    Returns the previous setting."""
    return _C.set_num_threads(n)


def get_num_threads() -> int:
    """The count set by set_num_threads, else the automatic count for inputs other than torch tensors."""
    return _C.get_num_threads()


def build_info() -> dict:
    """What this build of brrr contains and what it found at run time."""
    info = dict(_C.build_info())
    info["version"] = __version__
    return info


# The PyTorch-only parts and brrr.diagnose load on first use, so that `import brrr` never imports
# torch; where torch is already imported, brrr's PyTorch layer loads now, so that torch.ops.brrr.*
# exist from here on (else on the first torch tensor: brrr/_frameworks.py). The modules behind them
# have other names (_registry, _patch): importing a submodule binds its name in this package, which
# would hide the registry object and the patch function.
# brrr.diagnose is the exception: that module is itself callable as the function.
_LAZY = {"registry": ("_registry", "registry"), "UnsupportedError": ("_registry", "UnsupportedError"),
         "nn": ("nn", None), "patch": ("_patch", "patch"), "unpatch": ("_patch", "unpatch"),
         "use_fused": ("_patch", "use_fused"), "causal_lm_loss": ("_patch", "causal_lm_loss"),
         "graphs": ("graphs", None), "capture_step": ("graphs", "capture_step"),
         "remat": ("remat", None), "norm_linear": ("remat", "norm_linear"), "glu_linear": ("remat", "glu_linear"),
         "diagnose": ("diagnose", None)}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'brrr' has no attribute {name!r}")
    import importlib

    module_name, attribute = _LAZY[name]
    if module_name == "_registry":  # its ops are registered by the families' PyTorch layer
        import torch  # noqa: F401 - which needs it

        _frameworks.load_torch_layer()
    module = importlib.import_module(f"{__name__}.{module_name}")
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


if sys.modules.get("torch") is not None:  # None: torch blocked (sys.modules["torch"] = None), as if absent
    _frameworks.load_torch_layer()

__all__ = [
    "Chain",
    "UnsupportedError",
    "capture_step",
    "causal_lm_loss",
    "glu_linear",
    "norm_linear",
    "remat",
    "diagnose",
    "graphs",
    "nn",
    "patch",
    "registry",
    "unpatch",
    "use_fused",
    "add_layer_norm",
    "apply_rotary_pos_emb",
    "add_rms_norm",
    "bias_dropout_add",
    "bias_gelu",
    "bias_silu",
    "geglu",
    "swiglu",
    "build_info",
    "chain",
    "cos",
    "cross_entropy",
    "cuda_available",
    "get_num_threads",
    "exp",
    "gelu",
    "layer_norm",
    "linear_cross_entropy",
    "log_softmax",
    "relu",
    "rms_norm",
    "rotary",
    "set_num_threads",
    "sigmoid",
    "silu",
    "sin",
    "softmax",
    "tanh",
]
