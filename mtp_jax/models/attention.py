"""Decode attention over an explicit KV cache: dense (the reference) and blocked.

A decode step is bound by the bytes it reads. Dense attention reads every one of the cache's S
positions and masks those past each row's length; blocked attention reads the cache in blocks of
`block` positions up to the batch's furthest key (a `fori_loop` whose trip count is data, with an
online softmax, flash-decoding style), so its cost follows the rows' lengths, not S. Shapes stay
static: S and the block size are compile-time, the number of blocks read is a traced value, so
rows growing across block boundaries never recompile.

Masks (both implementations): a query attends to the keys at cache positions before its step's
first token (the row's history), and among the step's own T tokens (written at consecutive
positions start .. start+T-1) to those `query_mask_TT[t, j]` allows; the default is causal. A
tree step passes its ancestor mask there (its rotary positions need not be consecutive then; the
cache slots are). `key_limit_B`: keys past this position are skipped except the query's own (the
sequential heads' drafting); `key_min`: positions below it hold nothing (a sequential module's
first input).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.models import cache as kv

IMPLS = ("dense", "blocked")
_NEG = -1e30    # masked logits: finite, so a fully masked block cannot produce NaN


def mask(kpos_BS, pos_BT, key_limit_B=None, key_min: int = 0, query_mask_TT=None):
  """Which keys (at cache positions kpos_BS) each query may attend -> bool [B, T, S]."""
  t = pos_BT.shape[1]
  start_B = pos_BT[:, 0]
  if query_mask_TT is None:
    qslot_BT = pos_BT
    m = kpos_BS[:, None, :] <= qslot_BT[:, :, None]
  else:
    qslot_BT = start_B[:, None] + jnp.arange(t)[None]
    j_BS = kpos_BS - start_B[:, None]          # index among the step's own tokens
    own_TBS = jnp.take(query_mask_TT, jnp.clip(j_BS, 0, t - 1), axis=1)
    inside_BS = (j_BS >= 0) & (j_BS < t)
    m = (j_BS < 0)[:, None, :] | (inside_BS[:, None, :] & jnp.moveaxis(own_TBS, 0, 1))
  if key_limit_B is not None:
    m &= ((kpos_BS[:, None, :] <= key_limit_B[:, None, None])
          | (kpos_BS[:, None, :] == qslot_BT[:, :, None]))
  if key_min:
    m &= kpos_BS[:, None, :] >= key_min
  return m


def _group(q_BTNH, g: int):
  b, t, n, h = q_BTNH.shape
  return q_BTNH.reshape(b, t, g, n // g, h)


def dense(q_BTNH, k_BSGH, v_BSGH, mask_BTS):
  """Softmax attention over all S keys (GQA: N query heads over G kv heads)."""
  b, t, n, h = q_BTNH.shape
  q = _group(q_BTNH, k_BSGH.shape[2])
  logits = jnp.einsum("BTGRH,BSGH->BGRTS", q, k_BSGH).astype(jnp.float32) * h ** -0.5
  logits = jnp.where(mask_BTS[:, None, None], logits, _NEG)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_BSGH.dtype)
  return jnp.einsum("BGRTS,BSGH->BTGRH", probs, v_BSGH).reshape(b, t, n, h)


def attend_cache(q_BTNH, layer: kv.LayerKV, pos_BT, key_limit_B=None, key_min: int = 0,
                 query_mask_TT=None, impl: str | None = None):
  """Attention of the step's queries over a layer's cache (the step's own K/V already written
  into it); impl defaults to the layer's. -> [B, T, N, H] in q's dtype."""
  impl = impl or layer.attention
  if impl not in IMPLS:
    raise ValueError(f"attention={impl!r}: must be one of {IMPLS}")
  dt = q_BTNH.dtype
  if impl == "blocked":
    return blocked(q_BTNH, layer, pos_BT, key_limit_B, key_min, query_mask_TT)
  b, s = layer.k.shape[:2]
  kpos_BS = jnp.broadcast_to(jnp.arange(s), (b, s))
  m = mask(kpos_BS, pos_BT, key_limit_B, key_min, query_mask_TT)
  return dense(q_BTNH, kv.dequantize(layer.k, layer.k_scale, dt),
               kv.dequantize(layer.v, layer.v_scale, dt), m)


def n_blocks(pos_BT, s: int, block: int):
  """Blocks of `block` positions that hold every key the step may read: up to the furthest
  query's slot (start + T - 1) over the batch (a traced int32)."""
  furthest = jnp.minimum(jnp.max(pos_BT[:, 0]) + pos_BT.shape[1], s)
  return (furthest + block - 1) // block


def blocked(q_BTNH, layer: kv.LayerKV, pos_BT, key_limit_B=None, key_min: int = 0,
            query_mask_TT=None):
  """Online-softmax attention over the cache's live blocks (see the module doc)."""
  b, t, n, h = q_BTNH.shape
  s, g = layer.k.shape[1], layer.k.shape[2]
  blk = min(layer.block, s)
  dt = q_BTNH.dtype
  q_BGRTH = jnp.moveaxis(_group(q_BTNH, g), 1, 3)
  r = n // g

  def body(i, carry):
    m_BGRT, l_BGRT, acc_BGRTH = carry
    # The last block starts at s - blk when blk does not divide s; the keys it shares with the
    # block before are masked out, so each position counts once.
    lo = i * blk
    s0 = jnp.minimum(lo, s - blk)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, s0, blk, axis=1)
    kb = kv.dequantize(take(layer.k), None if layer.k_scale is None else take(layer.k_scale), dt)
    vb = kv.dequantize(take(layer.v), None if layer.v_scale is None else take(layer.v_scale), dt)
    kpos = s0 + jnp.arange(blk)
    mb_BTS = mask(jnp.broadcast_to(kpos, (b, blk)), pos_BT, key_limit_B, key_min, query_mask_TT)
    mb_BTS &= (kpos >= lo)[None, None, :]
    logits = jnp.einsum("BGRTH,BSGH->BGRTS", q_BGRTH, kb).astype(jnp.float32) * h ** -0.5
    mb = mb_BTS[:, None, None]
    logits = jnp.where(mb, logits, _NEG)
    m_new = jnp.maximum(m_BGRT, jnp.max(logits, -1))
    corr = jnp.exp(m_BGRT - m_new)
    p = jnp.where(mb, jnp.exp(logits - m_new[..., None]), 0.0)
    l_new = l_BGRT * corr + jnp.sum(p, -1)
    pv = jnp.einsum("BGRTS,BSGH->BGRTH", p.astype(dt), vb).astype(jnp.float32)
    return m_new, l_new, acc_BGRTH * corr[..., None] + pv

  init = (jnp.full((b, g, r, t), _NEG, jnp.float32), jnp.zeros((b, g, r, t), jnp.float32),
          jnp.zeros((b, g, r, t, h), jnp.float32))
  _, l, acc = jax.lax.fori_loop(0, n_blocks(pos_BT, s, blk), body, init)
  # A query with no key at all (positions below key_min) gets zeros, not NaN.
  out_BGRTH = acc / jnp.maximum(l, 1e-30)[..., None]
  return jnp.moveaxis(out_BGRTH, 3, 1).reshape(b, t, n, h).astype(dt)
