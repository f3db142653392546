"""Preallocated KV cache, indexed by absolute position.

Slot s of a row holds the K/V of the token at position s. A forward pass writes the K/V of its
tokens before attending, and attention masks keys at positions beyond the query's, so entries past
a row's committed length are never read: rolling back rejected drafts is only a shorter length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.config import ModelConfig


@struct.dataclass
class KVCache:
  """Per layer, k and v of shape [B, S, G, H]."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int | None = None,
               dtype=jnp.float32) -> KVCache:
  max_len = max_len or cfg.max_seq_len
  shape = (batch_size, max_len, cfg.n_kv_heads, cfg.head_dim)
  zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  return KVCache(k=zeros(), v=zeros())


def cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, itemsize: int = 4) -> int:
  return 2 * cfg.n_layers * batch_size * max_len * cfg.n_kv_heads * cfg.head_dim * itemsize


def write(buf_BSGH: jax.Array, new_BTGH: jax.Array, start_B: jax.Array) -> jax.Array:
  """Writes each row's T new entries at positions start_B[b] .. start_B[b] + T - 1."""
  def one(buf_SGH, new_TGH, start):
    return jax.lax.dynamic_update_slice(buf_SGH, new_TGH.astype(buf_SGH.dtype), (start, 0, 0))
  return jax.vmap(one)(buf_BSGH, new_BTGH, start_B)
