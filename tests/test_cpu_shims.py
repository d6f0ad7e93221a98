"""The CPU rotary-embedding shim rotates exactly as SGLang's own pure-PyTorch rotary embedding does."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests import sglang_env

# Run by SGLang's interpreter with the shims on PYTHONPATH: our kernel against RotaryEmbedding.forward_native,
# NeoX and GPT-J styles, full and partial rotary dims, on a view of a packed QKV tensor as SGLang passes it.
_COMPARE = """
import torch
from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
from vllm._custom_ops import rotary_embedding
torch.manual_seed(0)
tokens, heads, kv_heads, head = 7, 4, 2, 16
for neox in (True, False):
    for rotary_dim in (16, 8):
        rope = RotaryEmbedding(head, rotary_dim, 64, 10000, neox, torch.float32)
        positions = torch.tensor([0, 1, 2, 5, 9, 33, 63])
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head)
        q, k, _ = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
        want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
        rotary_embedding(positions, q, k, head, rope.cos_sin_cache, neox)
        torch.testing.assert_close(q, want_q)
        torch.testing.assert_close(k, want_k)
print("ok")
"""


@pytest.mark.sglang
def test_rotary_shim_matches_sglang_native_rotary(sglang_python: Path):
    env = {**os.environ, "PYTHONPATH": str(sglang_env.CPU_SHIMS_DIR)}
    done = subprocess.run([str(sglang_python), "-c", _COMPARE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
