"""Drop-in modules: subclasses of their torch.nn twins (same parameters, buffers, state_dict and
constructor), whose forward runs brrr's fused kernels through the registry.

    norm = brrr.nn.LayerNorm(4096)        # like torch.nn.LayerNorm(4096)
    norm.load_state_dict(torch_norm.state_dict())    # and the other way round
"""

import torch

from . import remat
from ._registry import registry


class LayerNorm(torch.nn.LayerNorm):
    def forward(self, x):
        return registry("layer_norm", x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm; cast_order="llama" rounds the normalised input before scaling, as
    Llama-style models do, and offset=1.0 scales by (1 + weight) in float32, as Gemma's RMSNorm
    does (see brrr.rms_norm)."""

    cast_order = "torch"
    offset = 0.0

    def forward(self, x):
        return registry("rms_norm", x, self.normalized_shape, self.weight, self.eps, cast_order=self.cast_order,
                        offset=self.offset)


class GELU(torch.nn.GELU):
    def forward(self, x):
        return registry("gelu", x, approximate=self.approximate)


class SiLU(torch.nn.SiLU):
    def forward(self, x):
        return registry("silu", x)


class ReLU(torch.nn.ReLU):
    def forward(self, x):
        return registry("relu", x)


class Sigmoid(torch.nn.Sigmoid):
    def forward(self, x):
        return registry("sigmoid", x)


class Tanh(torch.nn.Tanh):
    def forward(self, x):
        return registry("tanh", x)


class SwiGLU(torch.nn.Module):
    """silu(x[..., :d]) * x[..., d:]: the activation of a fused gate/up projection."""

    def forward(self, x):
        return registry("swiglu", x)


class GeGLU(torch.nn.Module):
    """gelu(x[..., :d]) * x[..., d:]."""

    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return registry("geglu", x, approximate=self.approximate)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss; inputs brrr does not take (per-class weights, probability
    targets) go to PyTorch's."""

    def forward(self, input, target):
        return registry("cross_entropy", input, target, self.weight, ignore_index=self.ignore_index,
                        reduction=self.reduction, label_smoothing=self.label_smoothing)


class Softmax(torch.nn.Softmax):
    def forward(self, input):
        return registry("softmax", input, self.dim)


class LogSoftmax(torch.nn.LogSoftmax):
    def forward(self, input):
        return registry("log_softmax", input, self.dim)


class LinearCrossEntropyLoss(torch.nn.Module):
    """The cross-entropy of a linear layer's output, brrr.linear_cross_entropy: forward(input,
    weight, target, bias=None) never holds the logits whole (no torch.nn twin)."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None, z_loss=0.0):
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.softcap, self.z_loss = softcap, z_loss

    def forward(self, input, weight, target, bias=None):
        return registry("linear_cross_entropy", input, weight, target, bias, ignore_index=self.ignore_index,
                        reduction=self.reduction, label_smoothing=self.label_smoothing, softcap=self.softcap,
                        z_loss=self.z_loss)


class RematLinear(torch.nn.Linear):
    """torch.nn.Linear that, fed a norm's or a GLU's output tagged by brrr.remat (as brrr.patch's
    remat=True tags them), saves what recomputes that output in the backward instead of the
    output itself (brrr.remat.linear); any other input as torch.nn.Linear."""

    def forward(self, x):
        return remat.linear(x, self.weight, self.bias)


# The torch.nn classes brrr.patch swaps exactly (their subclasses are checked by behaviour).
TWINS = {torch.nn.LayerNorm: LayerNorm, torch.nn.RMSNorm: RMSNorm, torch.nn.GELU: GELU, torch.nn.SiLU: SiLU,
         torch.nn.ReLU: ReLU, torch.nn.Sigmoid: Sigmoid, torch.nn.Tanh: Tanh, torch.nn.CrossEntropyLoss: CrossEntropyLoss,
         torch.nn.Softmax: Softmax, torch.nn.LogSoftmax: LogSoftmax}
