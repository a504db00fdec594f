"""Attention modules whose rotary embedding brrr.patch must treat with care, as transformers
writes them: GPT-NeoX's apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) rotates only the
first cos.shape[-1] dims of each head (partial rotary), and some models keep heads in dim 2 and
pass unsqueeze_dim=2 by position. STYLES: the other forms of the function, as Cohere (interleaved
pairs, in float32), GLM (interleaved pairs, each pair's angle from the first half of the given
ones, partial) and DeepSeek V3 (GLM's pairs and angles, the results in halves) write them, and a
look-alike turning the other way."""

import torch
import torch.nn as nn

from rope_model import rotate_half


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def rotate_interleaved(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rotary_pos_emb_cohere(q, k, cos, sin, unsqueeze_dim=1):
    dtype = q.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return ((q * cos + rotate_interleaved(q) * sin).to(dtype), (k * cos + rotate_interleaved(k) * sin).to(dtype))


def apply_rotary_pos_emb_glm(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([q_rot * cos + rotate_interleaved(q_rot) * sin, q_pass], dim=-1)
    k_embed = torch.cat([k_rot * cos + rotate_interleaved(k_rot) * sin, k_pass], dim=-1)
    return q_embed, k_embed


def apply_rotary_pos_emb_deepseek(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """DeepSeek V3's apply_rotary_pos_emb_interleave: interleaved pairs in, each pair's angle from
    the first half of the given ones, the pairs' results out in halves."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
            torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))


def apply_rotary_pos_emb_backwards(q, k, cos, sin, unsqueeze_dim=1):
    """Interleaved pairs turned the other way: no rotary embedding brrr knows."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos - rotate_interleaved(q) * sin, k * cos - rotate_interleaved(k) * sin


STYLES = {"neox": apply_rotary_pos_emb, "cohere": apply_rotary_pos_emb_cohere, "glm": apply_rotary_pos_emb_glm,
          "deepseek": apply_rotary_pos_emb_deepseek, "backwards": apply_rotary_pos_emb_backwards}


class VariantAttention(nn.Module):
    """q and k from one projection, rotated with angles over `rotary_dims` of each head's dims,
    heads in dim 1 (unsqueeze_dim by default) or dim 2 (passed by position)."""

    def __init__(self, rotary_dims, heads_dim, hidden=32, heads=4):
        super().__init__()
        self.heads, self.head_dim, self.rotary_dims, self.heads_dim = heads, hidden // heads, rotary_dims, heads_dim
        self.qk = nn.Linear(hidden, 2 * hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k = self.qk(x).view(b, t, 2, self.heads, self.head_dim).unbind(2)  # (b, t, h, d)
        angles = torch.arange(t, dtype=x.dtype)[None, :, None] * torch.linspace(0.1, 1, self.rotary_dims)
        cos, sin = angles.cos().expand(b, t, -1), angles.sin().expand(b, t, -1)
        if self.heads_dim == 1:
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        else:
            q, k = apply_rotary_pos_emb(q, k, cos, sin, 2)
        return q.sum(-1) + k.sum(-1)
