"""Preallocated KV cache, indexed by absolute position.

Slot s of a row holds the K/V of the token at position s. A forward pass writes the K/V of its
tokens before attending, and attention masks keys at positions beyond the query's, so entries past
a row's committed length are never read: rolling back rejected drafts is only a shorter length.

Storage: float (float32 / bfloat16) or quantised (int8, float8_e4m3fn) with one f32 scale per
(position, kv head): a step streams the cache, so storing it in a byte per value halves or
quarters what it reads. A token's K/V are quantised when written and dequantised inside attention,
the token's own included, so every forward pass (plain, verification, prefill) sees the same
numbers for a position. The cache also says how attention reads it (`attention`: 'dense' or
'blocked' in blocks of `block` positions, see attention.py); both are static, so an engine's
caches (the state's and a prefill's) share one tree structure.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.config import ModelConfig

# The largest magnitude each quantised storage type holds; the scale maps a (position, kv head)
# vector's max |x| onto it.
QUANT_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def is_quantized(dtype) -> bool:
  return jnp.dtype(dtype).name in QUANT_MAX


@struct.dataclass
class LayerKV:
  """One layer's cache: k, v [B, S, G, H]; k_scale, v_scale [B, S, G] f32 when quantised."""
  k: jax.Array
  v: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  attention: str = struct.field(pytree_node=False, default="dense")
  block: int = struct.field(pytree_node=False, default=128)


@struct.dataclass
class KVCache:
  """Per layer, k and v of shape [B, S, G, H] (and their scales [B, S, G] when quantised; None
  for float caches, so KVCache(k=..., v=...) is a float cache read densely)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  k_scale: tuple[jax.Array, ...] | None = None
  v_scale: tuple[jax.Array, ...] | None = None
  attention: str = struct.field(pytree_node=False, default="dense")
  block: int = struct.field(pytree_node=False, default=128)

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  def layer(self, i: int) -> LayerKV:
    ks = None if self.k_scale is None else self.k_scale[i]
    vs = None if self.v_scale is None else self.v_scale[i]
    return LayerKV(self.k[i], self.v[i], ks, vs, self.attention, self.block)

  def with_layers(self, layers: list[LayerKV]) -> "KVCache":
    scales = self.k_scale is not None
    return self.replace(
        k=tuple(x.k for x in layers), v=tuple(x.v for x in layers),
        k_scale=tuple(x.k_scale for x in layers) if scales else None,
        v_scale=tuple(x.v_scale for x in layers) if scales else None)


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int | None = None,
               dtype=jnp.float32, attention: str = "dense", block: int = 128) -> KVCache:
  max_len = max_len or cfg.max_seq_len
  shape = (batch_size, max_len, cfg.n_kv_heads, cfg.head_dim)
  zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.n_layers))
  scales = None
  if is_quantized(dtype):
    scales = lambda: tuple(jnp.ones(shape[:3], jnp.float32) for _ in range(cfg.n_layers))
  return KVCache(k=zeros(), v=zeros(), k_scale=scales and scales(), v_scale=scales and scales(),
                 attention=attention, block=block)


def cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, itemsize: int = 4) -> int:
  return 2 * cfg.n_layers * batch_size * max_len * cfg.n_kv_heads * bytes_per_value(
      cfg, itemsize)


def bytes_per_value(cfg: ModelConfig, itemsize: int) -> float:
  """Bytes per (position, kv head) of K or V: head_dim values, plus an f32 scale when the
  storage is a byte (quantised)."""
  return cfg.head_dim * itemsize + (4 if itemsize == 1 else 0)


def write(buf: jax.Array, new: jax.Array, start_B: jax.Array) -> jax.Array:
  """Writes each row's T new entries ([B, T, ...]) at positions start_B[b] .. start_B[b] + T - 1
  of buf [B, S, ...]."""
  def one(buf_S, new_T, start):
    idx = (start,) + (0,) * (buf_S.ndim - 1)
    return jax.lax.dynamic_update_slice(buf_S, new_T.astype(buf_S.dtype), idx)
  return jax.vmap(one)(buf, new, start_B)


def quantize(x_xH: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """-> (x in dtype, f32 scale [...] per vector over the last axis) with x ~ q * scale."""
  x = x_xH.astype(jnp.float32)
  top = QUANT_MAX[jnp.dtype(dtype).name]
  amax = jnp.max(jnp.abs(x), axis=-1)
  scale = jnp.where(amax > 0, amax / top, 1.0)
  y = x / scale[..., None]
  if jnp.dtype(dtype) == jnp.int8:
    y = jnp.clip(jnp.round(y), -top, top)
  return y.astype(dtype), scale


def dequantize(q_xH: jax.Array, scale_x: jax.Array | None, dtype) -> jax.Array:
  if scale_x is None:
    return q_xH.astype(dtype)
  return (q_xH.astype(jnp.float32) * scale_x[..., None]).astype(dtype)


def write_layer(layer: LayerKV, k_BTGH: jax.Array, v_BTGH: jax.Array,
                start_B: jax.Array) -> LayerKV:
  """The layer with the new tokens' K/V written (quantised when the layer is)."""
  if layer.k_scale is None:
    return layer.replace(k=write(layer.k, k_BTGH, start_B), v=write(layer.v, v_BTGH, start_B))
  qk, sk = quantize(k_BTGH, layer.k.dtype)
  qv, sv = quantize(v_BTGH, layer.v.dtype)
  return layer.replace(k=write(layer.k, qk, start_B), v=write(layer.v, qv, start_B),
                       k_scale=write(layer.k_scale, sk, start_B),
                       v_scale=write(layer.v_scale, sv, start_B))


def storage_dtype(kv_dtype: str, compute_dtype):
  """DecodeConfig.kv_dtype -> the cache's storage dtype ('auto': the compute dtype)."""
  return jnp.dtype(compute_dtype if kv_dtype == "auto" else kv_dtype)
