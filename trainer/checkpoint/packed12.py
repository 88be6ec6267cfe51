"""Orthonormal bases in 12 bits per entry: each column cut into blocks of :data:`BLOCK` entries,
every entry stored as a 12-bit integer step of its block's largest magnitude (a float16 scale per
block), two entries in three bytes.

An orthonormal basis's entries have no common exponent to share across a matrix, but within 64
entries of one column they do; 12 bits of a block's scale keep about as many significant bits as
float16 keeps of each entry, in 1.53 bytes per entry instead of 2 (:func:`packed_bytes`). A block's
scale is at least its largest magnitude and at most 1.002 times it; rounding moves each entry by at
most ``scale / (2·LEVELS)``.

Layout of a basis ``B`` (…×n×p): the columns, each padded with zeros to a multiple of
:data:`BLOCK`, in order (``B`` transposed to …×p×n); ``codes`` uint8 [blocks, BLOCK·3/2] and
``scales`` float16 [blocks].
"""

from __future__ import annotations

import math

import torch

#: Entries per block (each block belongs to one column).
BLOCK = 64
#: Largest code magnitude: an entry is ``code / LEVELS · scale`` with ``|code| <= LEVELS``.
LEVELS = 2047
_OFFSET = 2048  # codes are stored as code + _OFFSET in [1, 4095]: 12 bits


def packed_bytes(n: int, p: int, experts: int = 0) -> int:
    """Bytes of the codes and scales of an n×p basis (a bank of ``experts`` such bases)."""
    blocks = max(experts, 1) * p * math.ceil(n / BLOCK)
    return blocks * (BLOCK * 3 // 2 + 2)


def pack(B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``B`` (…×n×p, any float dtype): see the module docstring."""
    n = B.shape[-2]
    cols = B.detach().to(torch.float32).transpose(-1, -2).reshape(-1, n)
    pad = -n % BLOCK
    blocks = torch.nn.functional.pad(cols, (0, pad)).reshape(-1, BLOCK)
    scales = (blocks.abs().amax(dim=1) * (1 + 2.0**-10)).to(torch.float16)  # rounded to float16, still >= every |entry|
    step = scales.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(1)
    codes = (torch.round(blocks / step * LEVELS).clamp(-LEVELS, LEVELS) + _OFFSET).to(torch.int32)
    low, high = codes[:, 0::2], codes[:, 1::2]
    packed = torch.stack([low & 0xFF, (low >> 8) | ((high & 0xF) << 4), high >> 4], dim=2)
    return packed.reshape(blocks.shape[0], BLOCK * 3 // 2).to(torch.uint8), scales


def unpack(codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 basis of ``shape`` (…×n×p) that :func:`pack` stored as ``codes`` and ``scales``.

    Raises:
        ValueError: ``codes`` or ``scales`` do not hold a basis of ``shape``.
    """
    *lead, n, p = shape
    blocks = math.prod(lead) * p * math.ceil(n / BLOCK)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != (blocks, BLOCK * 3 // 2) or tuple(scales.shape) != (blocks,):
        raise ValueError(f"codes {tuple(codes.shape)} {codes.dtype} and scales {tuple(scales.shape)} do not hold "
                         f"a {'×'.join(map(str, shape))} basis ({blocks} blocks of {BLOCK})")
    triples = codes.to(torch.int32).reshape(blocks, BLOCK // 2, 3)
    low = triples[..., 0] | ((triples[..., 1] & 0xF) << 8)
    high = (triples[..., 1] >> 4) | (triples[..., 2] << 4)
    values = torch.stack([low, high], dim=2).reshape(blocks, BLOCK).float() - _OFFSET
    values = values / LEVELS * scales.float().unsqueeze(1)
    cols = values.reshape(math.prod(lead), p, math.ceil(n / BLOCK) * BLOCK)[..., :n]
    return cols.reshape(*lead, p, n).transpose(-1, -2).contiguous()
