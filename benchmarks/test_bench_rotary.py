"""Rotary position embedding (transformers' apply_rotary_pos_emb on q and k) against PyTorch
eager (the library's own formula) and torch.compile, in one run.

GPU: Llama-shaped attention inputs, batch 32 x 512 tokens, bfloat16 and float32: 16 heads of 64
with q and k the transposed views attention blocks make of their projections (B, S, H, D) ->
(B, H, S, D), and 8 heads of 128 contiguous. CPU, or BRRR_BENCH_QUICK=1: a quick smoke version
without torch.compile.

bytes_moved is the fewest bytes a pass must move: forward reads q and k and writes their rotations
(4 passes over one of them) plus cos and sin once (they broadcast over the heads); forward+backward
also reads both output gradients and writes both input gradients (8 passes, cos and sin twice).
brrr's results are checked against the float64 reference of tests/test_rotary.py first. At these
sizes a call's host time can exceed its kernels' (the event timings then measure the host), so the
GPU rows also record kernel_ms, the summed device time of one call's kernels (torch.profiler).

test_rotary_layouts: the other layouts of transformers' models, against their own function
(eager) and its torch.compile: Cohere's interleaved pairs, GLM's interleaved pairs over half the
head (each pair's angle from the first half of the given ones) and GPT-NeoX's halves over a
quarter of it, bfloat16, 16 heads of 128 (the passed-through features are copied: the same bytes).
"""

import importlib
import os

import pytest
import torch

import brrr
from harness import compiled, device, kernel_ms, on_gpu, time_ms
from test_rotary import reference

QUICK = not on_gpu() or os.environ.get("BRRR_BENCH_QUICK") == "1"
BATCH, SEQ = (32, 512) if not QUICK else (2, 16)
LAYOUTS = [("transposed", 16, 64), ("contiguous", 8, 128)] if not QUICK else [("transposed", 4, 16)]
MAX_TIME_S = 2.0 if not QUICK else 0.1
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager_apply_rotary_pos_emb(q, k, cos, sin):
    """transformers' Llama apply_rotary_pos_emb."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _inputs(layout, heads, dim, dtype):
    def one():
        if layout == "transposed":
            t = torch.randn(BATCH, SEQ, heads, dim, device=device(), dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(BATCH, heads, SEQ, dim, device=device(), dtype=dtype)
        return t.requires_grad_()

    angles = torch.randn(BATCH, SEQ, dim // 2, device=device()).repeat(1, 1, 2) * 10
    return one(), one(), angles.cos().to(dtype), angles.sin().to(dtype)


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout,heads,dim", LAYOUTS)
def test_rotary(recorder, layout, heads, dim, dtype):
    q, k, cos, sin = _inputs(layout, heads, dim, dtype)
    with torch.no_grad():
        ours = brrr.apply_rotary_pos_emb(q, k, cos, sin)
        for got, x in zip(ours, (q, k)):
            expected = reference(x.double(), cos.double()[:, None], sin.double()[:, None])
            assert _rel_err(got, expected) < TOL[dtype]
    grads = [torch.randn_like(t) for t in ours]
    impls = {"brrr": brrr.apply_rotary_pos_emb, "eager": eager_apply_rotary_pos_emb,
             "compile": None if QUICK else compiled(eager_apply_rotary_pos_emb)}
    unit = q.numel() * q.element_size()
    angle_bytes = 2 * cos.numel() * cos.element_size()
    for impl, fn in impls.items():
        if fn is None:
            continue
        with torch.no_grad():
            fwd_ms = time_ms(lambda: fn(q, k, cos, sin), max_time_s=MAX_TIME_S)

        def step():
            return torch.autograd.grad(fn(q, k, cos, sin), (q, k), grads)

        if impl == "brrr":
            expected_grads = torch.autograd.grad(eager_apply_rotary_pos_emb(q, k, cos, sin), (q, k), grads)
            for got, want in zip(step(), expected_grads):
                assert _rel_err(got, want) < TOL[dtype]
        common = dict(family="rotary", op=f"apply_rotary_pos_emb {layout} {heads}x{dim}", dtype=dtype,
                      shape=tuple(q.shape), impl=impl)
        step_ms = time_ms(step, max_time_s=MAX_TIME_S)
        kernels = {}
        if on_gpu():  # these calls are short enough for the host to set their time: the kernels' own
            with torch.no_grad():
                kernels["fwd"] = kernel_ms(lambda: fn(q, k, cos, sin))
            kernels["fwd+bwd"] = kernel_ms(step)
        for pass_, ms, moved in (("fwd", fwd_ms, 4 * unit + angle_bytes),
                                 ("fwd+bwd", step_ms, 8 * unit + 2 * angle_bytes)):
            row = recorder.add_timing(pass_=pass_, ms=ms, bytes_moved=moved, kernel_ms=kernels.get(pass_), **common)
            if pass_ in kernels:
                row["kernel_frac_floor"] = row["floor_ms"] / kernels[pass_]


# (model family, interleaved, the rotated share of the head, angles given per pair)
FORMS = [("cohere", True, 1, False), ("glm", True, 2, True), ("gpt_neox", False, 4, False)]
FORM_HEADS, FORM_DIM = (16, 128) if not QUICK else (4, 16)


@pytest.mark.parametrize("family,interleaved,share,per_pair", FORMS)
def test_rotary_layouts(recorder, family, interleaved, share, per_pair):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    dtype, r = torch.bfloat16, FORM_DIM // share
    q, k = (torch.randn(BATCH, FORM_HEADS, SEQ, FORM_DIM, device=device(), dtype=dtype).requires_grad_()
            for _ in range(2))
    freqs = torch.randn(BATCH, SEQ, r // 2, device=device()) * 10
    emb = freqs.repeat_interleave(2, -1) if family == "cohere" else torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # as the model's rotary embedding gives them
    angles = (cos[..., :r // 2], sin[..., :r // 2]) if per_pair else (cos, sin)

    def ours(q, k):
        return brrr.apply_rotary_pos_emb(q, k, *angles, interleaved=interleaved, rotary_dim=r)

    def theirs(q, k):
        return module.apply_rotary_pos_emb(q, k, cos, sin)

    with torch.no_grad():
        expected = module.apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
        for got, want in zip(ours(q, k), expected):
            assert _rel_err(got, want) < TOL[dtype]
    grads = [torch.randn_like(q), torch.randn_like(k)]
    for got, want in zip(torch.autograd.grad(ours(q, k), (q, k), grads),
                         torch.autograd.grad(theirs(q, k), (q, k), grads)):
        assert _rel_err(got, want) < TOL[dtype]
    unit = q.numel() * q.element_size()
    angle_bytes = 2 * angles[0].numel() * angles[0].element_size()
    for impl, fn in {"brrr": ours, "eager": theirs, "compile": None if QUICK else compiled(theirs)}.items():
        if fn is None:
            continue
        with torch.no_grad():
            fwd_ms = time_ms(lambda: fn(q, k), max_time_s=MAX_TIME_S)
        step_ms = time_ms(lambda: torch.autograd.grad(fn(q, k), (q, k), grads), max_time_s=MAX_TIME_S)
        common = dict(family="rotary", op=f"{family} rotary {FORM_HEADS}x{FORM_DIM}, {r} rotated", dtype=dtype,
                      shape=tuple(q.shape), impl=impl)
        recorder.add_timing(pass_="fwd", ms=fwd_ms, bytes_moved=4 * unit + angle_bytes, **common)
        recorder.add_timing(pass_="fwd+bwd", ms=step_ms, bytes_moved=8 * unit + 2 * angle_bytes, **common)
