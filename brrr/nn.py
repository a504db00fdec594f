"""Drop-in modules: subclasses of their torch.nn twins (same parameters, buffers, state_dict and
constructor), whose forward runs brrr's fused kernels through the registry.

    norm = brrr.nn.LayerNorm(4096)        # like torch.nn.LayerNorm(4096)
    norm.load_state_dict(torch_norm.state_dict())    # and the other way round

Each family declares its modules beside its ops (the `modules` of its PyTorch integration,
brrr/<family>.py); they are this module's names. A module whose class subclasses a torch.nn class
is that class's twin: brrr.patch swaps modules of exactly that class for it.
"""

import copy

import torch

from . import _op, remat

# What brrr.patch keeps in the __dict__ of a module it changed, every key beginning with BOOKKEEPING:
# the module's class before the patch, and what setting its loss_function replaced ({name: the
# value before, or MISSING where there was none}).
BOOKKEEPING = "_brrr_"
ORIGINAL_CLASS = BOOKKEEPING + "original_class"
ORIGINAL_LOSS = BOOKKEEPING + "original_loss_attributes"


class _Missing:
    def __reduce__(self):  # pickled by name, so that a pickled module's bookkeeping still finds it
        return "MISSING"

    def __repr__(self):
        return "brrr.nn.MISSING"


MISSING = _Missing()


def reduce_as_original(module, protocol):
    """__reduce_ex__ of the classes brrr.patch swaps modules into: pickling a swapped module
    (torch.save(model), pickle, multiprocessing) saves it as it was before the patch, its original
    class without brrr's bookkeeping, so that it loads without brrr (patch it again after loading);
    any other module pickles as torch.nn.Module does."""
    original = module.__dict__.get(ORIGINAL_CLASS)
    if original is None:
        return object.__reduce_ex__(module, protocol)
    state = {k: v for k, v in module.__getstate__().items() if not k.startswith(BOOKKEEPING)}
    for name, value in module.__dict__.get(ORIGINAL_LOSS, {}).items():
        if value is MISSING:
            state.pop(name, None)
        else:
            state[name] = value
    return object.__new__, (original,), state


def copy_as_is(module):
    """__copy__ of those classes: copy.copy makes a shallow copy as it is, patched (as it copies any
    module), where reduce_as_original would give the module before the patch."""
    copied = object.__new__(type(module))
    copied.__setstate__(module.__getstate__())
    return copied


def deepcopy_as_is(module, memo):
    """__deepcopy__ of those classes: copy.deepcopy copies a swapped module as it is, patched (as
    it copies any module), where reduce_as_original would give the module before the patch."""
    copied = object.__new__(type(module))
    memo[id(module)] = copied
    copied.__setstate__(copy.deepcopy(module.__getstate__(), memo))
    return copied


def pickles_as_original(cls):
    """cls, a class that brrr.patch swaps modules into, with the three above."""
    cls.__reduce_ex__, cls.__copy__, cls.__deepcopy__ = reduce_as_original, copy_as_is, deepcopy_as_is
    return cls


@pickles_as_original  # patch swaps torch.nn.Linear for it
class RematLinear(torch.nn.Linear):
    """torch.nn.Linear that, fed a norm's or a GLU's output tagged by brrr.remat (as brrr.patch's
    remat=True tags them), saves what recomputes that output in the backward instead of the
    output itself (brrr.remat.linear); any other input as torch.nn.Linear."""

    def forward(self, input):  # torch.nn.Linear's argument name
        return remat.linear(input, self.weight, self.bias)


TWINS = {}  # torch.nn class -> its brrr.nn twin
for _family in _op.INTEGRATIONS:
    for _module in _family.modules:
        _module.__module__, _module.__qualname__ = __name__, _module.__name__  # as pickle finds them
        _module.forward.__qualname__ = f"{_module.__name__}.forward"  # as errors name it
        pickles_as_original(_module)  # patch swaps modules for them
        globals()[_module.__name__] = _module
        if _module.__base__ is not torch.nn.Module:
            TWINS[_module.__base__] = _module
