"""brrr.patch, brrr.unpatch and brrr.use_fused leave the user's random streams alone: the global
CPU and CUDA generators are in the same state after them as before, so a patched model sees the
same data order and dropout masks as an unpatched one."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import brrr
from helpers import DEVICES
from test_registry import FusedGatedMLP, GatedMLP, LlamaStyleRMSNorm, NewGELU, PostNormResidual, TinyCausalLM


class DrawingActivation(nn.Module):
    """A parameterless module whose forward draws from the global generator (patch probes such
    modules to see whether they are an activation)."""

    def forward(self, x):
        return x + torch.rand_like(x)


class ProbedModel(nn.Module):
    """One module of every kind brrr.patch probes by behaviour, and dropouts in training mode."""

    def __init__(self, hidden=16):
        super().__init__()
        self.norm = LlamaStyleRMSNorm(hidden)
        self.act = NewGELU()
        self.mlp = GatedMLP(hidden, 32)
        self.fused_mlp = FusedGatedMLP(hidden, 32)
        self.residual = PostNormResidual(32, hidden, p=0.5)
        self.dropout = nn.Dropout(0.5)
        self.drawing = DrawingActivation()
        self.lm = TinyCausalLM("llama")


def generator_states(device):
    states = [torch.get_rng_state()]
    if device == "cuda":
        states += torch.cuda.get_rng_state_all()
    return states


def assert_same_states(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_patch_unpatch_and_use_fused_leave_the_global_generators_alone(device):
    model = ProbedModel().to(device).train()
    torch.manual_seed(1234)
    if device == "cuda":
        torch.cuda.manual_seed_all(1234)
    before = generator_states(device)
    report = brrr.patch(model)
    swapped = {name for name, _, _ in report.swapped}
    assert {"norm", "act", "mlp", "fused_mlp", "residual", "lm"} <= swapped, report
    assert_same_states(generator_states(device), before)
    assert brrr.unpatch(model) >= len(swapped)
    assert_same_states(generator_states(device), before)
    x = torch.randn(4, 16, device=device)
    torch.manual_seed(1234)
    if device == "cuda":
        torch.cuda.manual_seed_all(1234)
    with brrr.use_fused():
        y = F.layer_norm(F.gelu(x), (16,))
    assert_same_states(generator_states(device), before)
    torch.testing.assert_close(y, F.layer_norm(F.gelu(x), (16,)))


def test_a_patched_model_draws_the_dropout_masks_of_an_unpatched_one():
    ones, model = torch.ones(1000), ProbedModel()
    torch.manual_seed(7)
    expected = F.dropout(ones, 0.5)
    torch.manual_seed(7)
    brrr.patch(model)
    torch.testing.assert_close(F.dropout(ones, 0.5), expected)
