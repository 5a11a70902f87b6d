"""A Llama-style decoder in plain PyTorch: the reference model every layout is tested on.

RMSNorm, rotary position embeddings, SwiGLU feed-forward (or a mixture of experts:
``LlamaConfig(moe=MoESpec(experts=8, top_k=2))``, :mod:`tessera.models.moe`), grouped-query
attention, tied or untied embeddings; sized entirely by :class:`LlamaConfig`.

Example:
    >>> model = Llama(LlamaConfig.tiny())
    >>> logits = model(torch.zeros(2, 16, dtype=torch.long))   # (batch, seq, vocab)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera.errors import PlanError
from tessera.models.moe import MoE, MoESpec
from tessera.parallel.sequence import sequence_start, ulysses_attention


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    moe: MoESpec | None = None  # experts in place of every block's feed-forward

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise PlanError(f"LlamaConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise PlanError(f"LlamaConfig.n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def tiny(cls, **overrides: object) -> LlamaConfig:
        """A model small enough for multi-process tests on two CPU cores."""
        return cls(**overrides)  # type: ignore[arg-type]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under bf16/fp16, then cast back.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the head dimension; x is (batch, heads, seq, head_dim)."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


def rotary_positions(module: nn.Module, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of ``module`` (a Llama or one of its pipeline stages) for ``seq`` positions.

    Under sequence parallelism the input is this rank's slice: positions start at its offset.
    """
    start = sequence_start(seq, module.sp_group)
    if start + seq > module.rope_cos.shape[0]:
        raise ValueError(f"sequence length {start + seq} exceeds LlamaConfig.max_seq_len={module.rope_cos.shape[0]}")
    return module.rope_cos[start : start + seq], module.rope_sin[start : start + seq]


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.sp_group = None  # set by the Ulysses policy hook: attention over the whole sequence

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.sp_group is not None:  # this rank holds a slice of the sequence
            out = ulysses_attention(q, k, v, self.sp_group)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))
        # Grouped-query attention: each key/value head serves n_heads / n_kv_heads query heads.
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        moe = cfg.moe
        self.feed_forward = MoE(cfg.dim, moe.hidden or cfg.ffn_dim, moe) if moe and moe.experts else FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only transformer; ``forward(tokens)`` returns logits of shape (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        # Not parameters and not saved: rebuilt from the config, so checkpoints hold weights only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.sp_group = None  # set by the Ulysses policy hook
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                # Scale residual output projections by depth (GPT-2 style).
                residual = name.endswith(("wo.weight", "w2.weight", "experts.w2"))  # (the experts' w2 too)
                scale = 1 / math.sqrt(2 * self.config.n_layers) if residual else 1
                nn.init.normal_(p, mean=0.0, std=std * scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        cos, sin = rotary_positions(self, tokens.shape[1])
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))
