"""Pure-PyTorch ``rotary_embedding``: the one vLLM kernel SGLang 0.5.23 needs on a CPU-only machine.

A CPU-test aid only (see ../README.md): SGLang's ``RotaryEmbedding`` imports it
when neither CUDA nor the official CPU engine is available, and calls it in
place of vLLM's CUDA kernel with the same contract.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [tokens, heads, rotary_dim]; cos, sin: [tokens, 1, rotary_dim // 2]
    if is_neox:  # rotate the two halves
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # GPT-J style: rotate interleaved pairs
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Apply rotary position embedding to ``query`` and ``key`` in place.

    Args:
        positions: token positions, any shape with ``T`` elements in total (int).
        query: ``[T, num_heads * head_size]`` or ``[T, num_heads, head_size]``
            (or with ``positions``' leading shape instead of ``T``); rotated in place.
        key: like ``query`` with ``num_kv_heads``, or ``None``.
        head_size: size of one attention head.
        cos_sin_cache: ``[max_position, rotary_dim]``; row ``p`` holds the cos
            values of position ``p`` in its first half and the sin values in its second.
        is_neox: rotate the two halves of the rotary part (NeoX style) rather
            than interleaved pairs (GPT-J style).

    Only the first ``rotary_dim`` features of each head are rotated; the rest are
    left as they are. Computes in float32 and writes back in the tensors' dtype.
    """
    flat_positions = positions.reshape(-1)
    tokens = flat_positions.numel()
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, flat_positions).float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(tokens, -1, head_size)
        rot = heads[..., :rotary_dim]
        rot.copy_(_rotate(rot.float(), cos, sin, is_neox).to(x.dtype))
