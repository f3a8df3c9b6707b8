"""A small GPT-style character-level transformer (after nanoGPT) and its training text.

The text is the Python standard library's own source files, present on every machine, read as
bytes: the vocabulary is the 256 byte values.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    context: int = 64
    width: int = 64
    layers: int = 2
    heads: int = 4


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, w))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * c.width, c.width)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.width)
        self.attn = Attention(c)
        self.ln2 = nn.LayerNorm(c.width)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer. Input int64 [batch, time] byte ids; output float32 logits
    [batch, time, 256]."""

    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.context, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def stdlib_text(max_bytes: int = 4 << 20) -> torch.Tensor:
    """uint8 [n] tensor: the standard library's top-level .py files, sorted by name, concatenated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for p in sorted(root.glob("*.py")):
        b = p.read_bytes()
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    if total < 10_000:
        raise RuntimeError(f"too little text under {root}: {total} bytes")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


def batch(text: torch.Tensor, seed: int, rank: int, step: int, size: int, context: int):
    """(inputs, targets), int64 [size, context] each: random windows, reproducible from
    (seed, rank, step) alone so a test can rebuild any rank's batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    start = torch.randint(0, len(text) - context - 1, (size,), generator=g)
    win = torch.stack([text[s : s + context + 1] for s in start.tolist()]).long()
    return win[:, :-1], win[:, 1:]
