"""Compression of the outer gradients that cross between ``Plan.groups``: bf16, int8 or 4-bit, with
error feedback.

int8 and 4-bit quantise blocks of ``BLOCK`` values by their largest magnitude (127 or 7 levels a
side; two 4-bit values share a byte) and send one fp32 scale per block. Error feedback keeps what
quantisation dropped and adds it to the next sync's values, so nothing is lost for good, only late
(INTELLECT-1 sends int8 outer gradients; Streaming DiLoCo 4-bit ones).

Quantised values cannot be summed where they are, so each group's payload is all-gathered as bytes
and every rank dequantises and adds them in group order: every group gets the same sum, bit for bit.

Example:
    >>> feedback = ErrorFeedback("int8")
    >>> payload = feedback.encode(values)          # bytes to send; the remainder stays behind
    >>> total = sum_payloads(gathered, "int8", values.numel())
"""

from __future__ import annotations

import torch

BLOCK = 256
_LEVELS = {"int8": 127, "int4": 7}


def encode(values: torch.Tensor, kind: str) -> torch.Tensor:
    """``values`` (1-D fp32) as the bytes ``kind`` (bf16, int8 or int4) sends: a uint8 tensor whose size
    depends only on ``values.numel()``. Uncompressed outer gradients are all-reduced, never encoded."""
    if kind == "bf16":
        return values.to(torch.bfloat16).contiguous().view(torch.uint8)
    levels = _LEVELS[kind]
    blocks = _blocks(values)
    scale = blocks.abs().amax(dim=1, keepdim=True) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / scale).clamp(-levels, levels).to(torch.int8)
    if kind == "int4":  # two values a byte: each stored as 0..14
        pairs = (q + levels).to(torch.uint8).view(-1, 2)
        body = pairs[:, 0] << 4 | pairs[:, 1]
    else:
        body = q.flatten().view(torch.uint8)
    return torch.cat([body.flatten(), scale.float().flatten().view(torch.uint8)])


def decode(payload: torch.Tensor, kind: str, numel: int) -> torch.Tensor:
    """The fp32 values ``payload`` (from :func:`encode` of ``numel`` values) stands for."""
    if kind == "bf16":
        return payload.view(torch.bfloat16)[:numel].float()
    levels = _LEVELS[kind]
    n_blocks = -(-numel // BLOCK)
    body_bytes = n_blocks * BLOCK // (2 if kind == "int4" else 1)
    body, scale = payload[:body_bytes], payload[body_bytes:].view(torch.float32).view(-1, 1)
    if kind == "int4":
        q = torch.stack([body >> 4, body & 0x0F], dim=1).to(torch.int16) - levels
    else:
        q = body.view(torch.int8).to(torch.int16)
    return (q.view(n_blocks, BLOCK).float() * scale).flatten()[:numel]


def _blocks(values: torch.Tensor) -> torch.Tensor:
    pad = (-values.numel()) % BLOCK
    flat = torch.cat([values, values.new_zeros(pad)]) if pad else values
    return flat.view(-1, BLOCK)


class ErrorFeedback:
    """Encodes values plus what earlier encodings dropped, and keeps what this one drops."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.remainder: torch.Tensor | None = None

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        if self.remainder is not None:
            values = values + self.remainder
        payload = encode(values, self.kind)
        self.remainder = values - decode(payload, self.kind, values.numel())
        return payload


def sum_payloads(gathered: torch.Tensor, kind: str, numel: int) -> torch.Tensor:
    """The sum, in group order, of the values each row of ``gathered`` (one payload per group) stands for."""
    total = decode(gathered[0], kind, numel).clone()
    for row in gathered[1:]:
        total += decode(row, kind, numel)
    return total
