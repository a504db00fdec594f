"""A tiny attention model with rotary embeddings, written as transformers' Llama writes them: a
module-level apply_rotary_pos_emb that the attention's forward calls as a global, which brrr.patch
replaces in the patched modules' forward."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


class RopeAttention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).transpose(1, 3).unbind(2)  # (b, h, t, d)
        with torch.no_grad():
            freqs = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * self.inv_freq[None]
            emb = torch.cat((freqs, freqs), dim=-1)[None].expand(b, t, self.head_dim)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        return x + self.proj(y)


class RopeModel(nn.Module):
    def __init__(self, vocab=61, hidden=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(RopeAttention(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
