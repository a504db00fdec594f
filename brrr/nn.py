"""Drop-in modules: subclasses of their torch.nn twins (same parameters, buffers, state_dict and
constructor), whose forward runs brrr's fused kernels through the registry.

    norm = brrr.nn.LayerNorm(4096)        # like torch.nn.LayerNorm(4096)
    norm.load_state_dict(torch_norm.state_dict())    # and the other way round

Each family declares its modules beside its ops (the `modules` of its PyTorch integration,
brrr/<family>.py); they are this module's names. A module whose class subclasses a torch.nn class
is that class's twin: brrr.patch swaps modules of exactly that class for it.
"""

import torch

from . import _op, remat


class RematLinear(torch.nn.Linear):
    """torch.nn.Linear that, fed a norm's or a GLU's output tagged by brrr.remat (as brrr.patch's
    remat=True tags them), saves what recomputes that output in the backward instead of the
    output itself (brrr.remat.linear); any other input as torch.nn.Linear."""

    def forward(self, x):
        return remat.linear(x, self.weight, self.bias)


TWINS = {}  # torch.nn class -> its brrr.nn twin
for _family in _op.INTEGRATIONS:
    for _module in _family.modules:
        _module.__module__, _module.__qualname__ = __name__, _module.__name__  # as pickle finds them
        globals()[_module.__name__] = _module
        if _module.__base__ is not torch.nn.Module:
            TWINS[_module.__base__] = _module
