"""Every public op once: its valid arguments (torch tensors, by the names its errors give them),
which of them are float tensors, its scalars with a value of the wrong type and a bad value,
and a float64 reference. The error-rule, tensor-kind, view-rank and fuzz tests walk this table,
so an op added here is checked by all of them."""

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import brrr

CHAIN = brrr.chain("add_tensor", ("mul", 2.0), "mul_tensor", "tanh")


@dataclass
class Op:
    name: str
    call: Callable  # call(args: dict) -> the result
    make: Callable  # make(dtype, device) -> valid args: tensors by name, and scalars
    floats: tuple  # the float tensor inputs, first the one the others are checked against
    reference: Callable  # reference(args) in float64
    out: bool = False  # takes out=
    bad_type: dict = field(default_factory=dict)  # scalar argument -> a value of the wrong type
    bad_value: dict = field(default_factory=dict)  # argument -> a value of the right type that is refused
    linear: bool = False  # linear in its first float input (a second derivative of 0)
    no_case: tuple = ()  # rules of docs/errors.md the op's arguments cannot break (beside "bad value")


def rand(*shape, dtype=torch.float32, device="cpu"):
    return (torch.rand(shape, dtype=torch.float64) * 4 - 2).to(device=device, dtype=dtype)


def _unary(name, fn, reference):
    return Op(name, lambda a: fn(a["x"], out=a.get("out")), lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev)},
              ("x",), lambda a: reference(a["x"]), out=True)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rms(x, w, eps):
    h = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return h * w


OPS = [
    _unary("relu", brrr.relu, torch.relu),
    _unary("gelu", brrr.gelu, F.gelu),
    _unary("silu", brrr.silu, F.silu),
    _unary("sigmoid", brrr.sigmoid, torch.sigmoid),
    _unary("tanh", brrr.tanh, torch.tanh),
    _unary("exp", brrr.exp, torch.exp),
    _unary("cos", brrr.cos, torch.cos),
    _unary("sin", brrr.sin, torch.sin),
    Op("chain", lambda a: CHAIN(a["x"], a["operands[0]"], a["operands[1]"], out=a.get("out")),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "operands[0]": rand(6, dtype=dt, device=dev),
                        "operands[1]": rand(4, 6, dtype=dt, device=dev)},
       ("x", "operands[0]", "operands[1]"), lambda a: torch.tanh((a["x"] + a["operands[0]"]) * 2 * a["operands[1]"]),
       out=True),
    Op("bias_gelu", lambda a: brrr.bias_gelu(a["x"], a["bias"], a["approximate"], out=a.get("out")),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "bias": rand(6, dtype=dt, device=dev),
                        "approximate": "tanh"},
       ("x", "bias"), lambda a: F.gelu(a["x"] + a["bias"], approximate="tanh"), out=True,
       bad_type={"approximate": 1}, bad_value={"approximate": "fast"}),
    Op("bias_silu", lambda a: brrr.bias_silu(a["x"], a["bias"], out=a.get("out")),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "bias": rand(4, 6, dtype=dt, device=dev)},
       ("x", "bias"), lambda a: F.silu(a["x"] + a["bias"]), out=True),
    Op("swiglu split", lambda a: brrr.swiglu(a["x"], out=a.get("out")),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev)},
       ("x",), lambda a: F.silu(a["x"].chunk(2, -1)[0]) * a["x"].chunk(2, -1)[1], out=True,
       bad_value={"x": rand(4, 5)}),
    Op("swiglu", lambda a: brrr.swiglu(a["gate"], a["up"], out=a.get("out")),
       lambda dt, dev: {"gate": rand(4, 6, dtype=dt, device=dev), "up": rand(4, 6, dtype=dt, device=dev)},
       ("gate", "up"), lambda a: F.silu(a["gate"]) * a["up"], out=True),
    Op("geglu", lambda a: brrr.geglu(a["gate"], a["up"], a["approximate"], out=a.get("out")),
       lambda dt, dev: {"gate": rand(4, 6, dtype=dt, device=dev), "up": rand(4, 6, dtype=dt, device=dev),
                        "approximate": "none"},
       ("gate", "up"), lambda a: F.gelu(a["gate"]) * a["up"], out=True,
       bad_type={"approximate": None}, bad_value={"approximate": "erf"}),
    Op("layer_norm", lambda a: brrr.layer_norm(a["x"], a["normalized_shape"], a["weight"], a["bias"], a["eps"]),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "normalized_shape": (6,),
                        "weight": rand(6, dtype=dt, device=dev), "bias": rand(6, dtype=dt, device=dev), "eps": 1e-5},
       ("x", "weight", "bias"), lambda a: F.layer_norm(a["x"], a["x"].shape[-1:], a["weight"], a["bias"], a["eps"]),
       bad_type={"eps": "1e-5", "normalized_shape": 6.0}, bad_value={"eps": 2**1100, "normalized_shape": (4,)}),
    Op("rms_norm", lambda a: brrr.rms_norm(a["x"], a["normalized_shape"], a["weight"], a["eps"],
                                           cast_order=a["cast_order"], offset=a["offset"]),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "normalized_shape": [6],
                        "weight": rand(6, dtype=dt, device=dev), "eps": 1e-6, "cast_order": "llama", "offset": 0.0},
       ("x", "weight"), lambda a: _rms(a["x"], a["weight"], a["eps"]),
       bad_type={"eps": [1e-6], "cast_order": 1, "normalized_shape": ("6",), "offset": "1"},
       bad_value={"cast_order": "hf", "normalized_shape": (3, 6), "offset": float("nan")}),
    Op("add_layer_norm", lambda a: brrr.add_layer_norm(a["x"], a["residual"], a["normalized_shape"], a["weight"],
                                                       a["bias"], a["eps"]),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "residual": rand(4, 6, dtype=dt, device=dev),
                        "normalized_shape": (6,),
                        "weight": rand(6, dtype=dt, device=dev), "bias": rand(6, dtype=dt, device=dev), "eps": 1e-5},
       ("x", "residual", "weight", "bias"),
       lambda a: (F.layer_norm(a["x"] + a["residual"], a["x"].shape[-1:], a["weight"], a["bias"], a["eps"]),
                  a["x"] + a["residual"]),
       bad_type={"eps": True}),
    Op("add_rms_norm", lambda a: brrr.add_rms_norm(a["x"], a["residual"], a["normalized_shape"], a["weight"],
                                                   a["eps"]),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "residual": rand(4, 6, dtype=dt, device=dev),
                        "normalized_shape": (6,),
                        "weight": rand(6, dtype=dt, device=dev), "eps": 1e-6},
       ("x", "residual", "weight"),
       lambda a: (_rms(a["x"] + a["residual"], a["weight"], a["eps"]), a["x"] + a["residual"]),
       bad_type={"eps": "tiny"}),
    Op("bias_dropout_add", lambda a: brrr.bias_dropout_add(a["x"], a["bias"], a["residual"], a["p"], a["training"],
                                                           a["seed"], a["offset"]),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "bias": rand(6, dtype=dt, device=dev),
                        "residual": rand(4, 6, dtype=dt, device=dev), "p": 0.0, "training": True, "seed": 5,
                        "offset": 0},
       ("x", "bias", "residual"), lambda a: a["residual"] + a["x"] + a["bias"],
       bad_type={"p": "0.1", "training": 1, "seed": 1.0, "offset": "0"},
       bad_value={"p": 1.5, "seed": -1, "offset": 2**63}, linear=True),
    Op("rotary", lambda a: brrr.rotary(a["x"], a["cos"], a["sin"], interleaved=a["interleaved"],
                                       rotary_dim=a["rotary_dim"]),
       lambda dt, dev: {"x": rand(2, 4, 6, dtype=dt, device=dev), "cos": rand(4, 6, dtype=dt, device=dev),
                        "sin": rand(4, 6, dtype=dt, device=dev), "interleaved": False, "rotary_dim": None},
       ("x", "cos", "sin"), lambda a: a["x"] * a["cos"] + _rotate_half(a["x"]) * a["sin"],
       bad_type={"interleaved": 1, "rotary_dim": 6.0}, bad_value={"x": rand(2, 4, 5), "rotary_dim": 8}, linear=True),
    Op("apply_rotary_pos_emb",
       lambda a: brrr.apply_rotary_pos_emb(a["q"], a["k"], a["cos"], a["sin"], unsqueeze_dim=a["unsqueeze_dim"]),
       lambda dt, dev: {"q": rand(2, 3, 4, 6, dtype=dt, device=dev), "k": rand(2, 1, 4, 6, dtype=dt, device=dev),
                        "cos": rand(2, 4, 6, dtype=dt, device=dev), "sin": rand(2, 4, 6, dtype=dt, device=dev),
                        "unsqueeze_dim": 1},
       ("q", "k", "cos", "sin"),
       lambda a: tuple(t * a["cos"][:, None] + _rotate_half(t) * a["sin"][:, None] for t in (a["q"], a["k"])),
       bad_type={"unsqueeze_dim": 1.0}, bad_value={"unsqueeze_dim": 5}, linear=True),
    Op("softmax", lambda a: brrr.softmax(a["x"], a["dim"], a["dtype"]),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "dim": -1, "dtype": None},
       ("x",), lambda a: torch.softmax(a["x"], a["dim"]),
       bad_type={"dim": 1.0, "dtype": "float32"}, bad_value={"dim": 2, "dtype": torch.int32},
       no_case=("mismatch",)),  # one tensor, no out
    Op("log_softmax", lambda a: brrr.log_softmax(a["x"], a["dim"]),
       lambda dt, dev: {"x": rand(4, 6, dtype=dt, device=dev), "dim": -1},
       ("x",), lambda a: torch.log_softmax(a["x"], a["dim"]), bad_type={"dim": None}, bad_value={"dim": -3},
       no_case=("mismatch",)),
    Op("linear_cross_entropy",
       lambda a: brrr.linear_cross_entropy(a["input"], a["weight"], a["target"], a["bias"], ignore_index=a["ignore_index"],
                                           reduction=a["reduction"], label_smoothing=a["label_smoothing"]),
       lambda dt, dev: {"input": rand(4, 6, dtype=dt, device=dev), "weight": rand(5, 6, dtype=dt, device=dev),
                        "bias": rand(5, dtype=dt, device=dev), "target": torch.tensor([0, 4, -100, 2], device=dev),
                        "ignore_index": -100, "reduction": "sum", "label_smoothing": 0.1},
       ("input", "weight", "bias"),
       lambda a: F.cross_entropy((a["input"] @ a["weight"].T + a["bias"]).flatten(0, -2), a["target"].flatten(),
                                 reduction="sum", label_smoothing=0.1),
       bad_type={"ignore_index": 1.0, "reduction": None, "label_smoothing": "0.1"},
       bad_value={"reduction": "avg", "label_smoothing": 2.0},
       no_case=("protocol",)),  # PyTorch tensors only (its GEMMs run in PyTorch): no DLPack producer is read
    Op("cross_entropy", lambda a: brrr.cross_entropy(a["input"], a["target"], None, a["ignore_index"], a["reduction"],
                                                     a["label_smoothing"]),
       lambda dt, dev: {"input": rand(4, 6, dtype=dt, device=dev), "target": torch.tensor([0, 5, -100, 2], device=dev),
                        "ignore_index": -100, "reduction": "sum", "label_smoothing": 0.1},
       ("input",), lambda a: F.cross_entropy(a["input"], a["target"], reduction="sum", label_smoothing=0.1),
       bad_type={"ignore_index": 1.0, "reduction": None, "label_smoothing": "0.1"},
       bad_value={"ignore_index": 2**70, "reduction": "avg", "label_smoothing": 2.0, "input": torch.tensor(1.0)}),
]
OPS_BY_NAME = {op.name: op for op in OPS}
