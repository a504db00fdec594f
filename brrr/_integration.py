"""How a family module declares its PyTorch integration without importing torch:

    @torch_integration
    def torch_layer():
        import torch
        ...                       # its TorchOps, registry entries, brrr.nn modules
        return SimpleNamespace(...)

    torch_layer().softmax(x, ...)  # the family's own calls, once a torch tensor reached them

brrr._op builds every integration declared here as it loads, which is when brrr first sees a torch
tensor (brrr._frameworks.torch_if_tensor) or at `import brrr` when torch is imported already. An
import is what dynamo runs for real, so a first call under torch.compile never traces a build.
brrr._op.INTEGRATIONS holds what they built: the registry entries are made by then, and brrr.nn and
brrr.use_fused read the modules and routes each family lists there.
"""

_GETTERS = []  # one per family, in the order the families declared them


def torch_integration(build):
    """Declare `build` (which imports torch) as a family's integration; returns the function that
    gives what it built, building it on first use."""
    built = []

    def get():
        if not built:
            built.append(build())
        return built[0]

    _GETTERS.append(get)
    return get


def declared():
    """The functions torch_integration returned, in the order the families declared them."""
    return list(_GETTERS)
