"""Training losses and the heads' agreement metric.

Batches are windows of W = seq_len + K + 1 tokens. The trunk runs on the first W - 1 and predicts
token t+1 at every position t; head i (1..K) at position t predicts token t+1+i, masked where that
lies past the window or past an end-of-document token. In heads_only mode, head i at t is taught
the trunk's own prediction at t+i (self-distillation), hard (argmax) or soft (its distribution).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtp_jax.decoding import shapes
from mtp_jax.models import model as model_lib


def head_targets(tokens_BW, num_heads: int, eod_id: int):
  """Targets and masks for the K heads at each of the W - 1 input positions.

  -> targets [B, W-1, K] (token t+1+i for head i), mask [B, W-1, K] (1 where the target exists
  inside the window and no end-of-document token lies in tokens t+1 .. t+i).
  """
  b, w = tokens_BW.shape
  t = w - 1
  targets, masks = [], []
  is_eod = tokens_BW == eod_id
  for i in range(1, num_heads + 1):
    idx = jnp.arange(t) + 1 + i                                   # target position
    valid = idx <= w - 1
    tgt = jnp.take(tokens_BW, jnp.minimum(idx, w - 1), axis=1)
    # EOD among tokens t+1 .. t+i means the target belongs to another document.
    crossed = jnp.zeros((b, t), bool)
    for j in range(1, i + 1):
      crossed |= jnp.take(is_eod, jnp.minimum(jnp.arange(t) + j, w - 1), axis=1)
    targets.append(tgt)
    masks.append(valid[None, :] & ~crossed)
  return jnp.stack(targets, -1), jnp.stack(masks, -1).astype(jnp.float32)


def shift_along(x_BTx, i: int):
  """x at position t + i for every t (the tail is padded with the last entry; mask it)."""
  t = x_BTx.shape[1]
  idx = jnp.minimum(jnp.arange(t) + i, t - 1)
  return jnp.take(x_BTx, idx, axis=1)


def _masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _xent(logits, target_ids=None, target_probs=None):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  if target_probs is not None:
    return -jnp.sum(target_probs * logp, axis=-1)
  return -jnp.take_along_axis(logp, target_ids[..., None], axis=-1)[..., 0]


def compute_losses(m: model_lib.MTPModel, tokens_BW, eod_id: int, mode: str,
                   distill_target: str = "hard", head_stride: int = 1):
  """-> (total loss, metrics). Head logits are formed one head at a time under remat, so peak
  memory holds one [B, T, V] block, not K of them (Gloeckle et al.). With head_stride > 1 the
  heads are trained on every head_stride-th position only: with K heads the unembedding runs K+1
  times per position and dominates a small model's FLOPs."""
  x_BT = tokens_BW[:, :-1]
  b, t = x_BT.shape
  k = m.heads_cfg.num
  pos_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
  h_BTD, _ = m(x_BT, pos_BT)
  if mode == "heads_only":
    h_BTD = jax.lax.stop_gradient(h_BTD)
  trunk_logits = m.logits(h_BTD)
  trunk_loss = jnp.mean(_xent(trunk_logits, tokens_BW[:, 1:]))
  head_tgt, head_mask = head_targets(tokens_BW, k, eod_id)
  if m.heads_cfg.kind == "sequential":   # modules attend along the sequence: run it whole
    hh_BTKD = m.head_hidden(h_BTD, tokens_BW)[:, ::head_stride]
  else:
    hh_BTKD = m.head_hidden(h_BTD[:, ::head_stride])
  head_tgt, head_mask = head_tgt[:, ::head_stride], head_mask[:, ::head_stride]

  teacher = None
  if mode == "heads_only":
    teacher_logits = jax.lax.stop_gradient(trunk_logits)
    if distill_target == "hard":
      teacher = ("ids", jnp.argmax(teacher_logits, -1))
    else:
      teacher = ("probs", jax.nn.softmax(teacher_logits, -1))
    teacher = (teacher[0], [shift_along(teacher[1], i)[:, ::head_stride] for i in range(1, k + 1)])

  @functools.partial(jax.checkpoint, static_argnums=(0,))
  def head_loss(i, hh_BTD, ids, probs, mask):
    logits = m.head_unembed(hh_BTD, head=i)
    return _masked_mean(_xent(logits, ids, probs), mask)

  head_losses = []
  for i in range(1, k + 1):
    mask = head_mask[..., i - 1]
    hh = hh_BTKD[:, :, i - 1]
    if teacher is None:
      loss_i = head_loss(i - 1, hh, head_tgt[..., i - 1], None, mask)
    elif teacher[0] == "ids":
      loss_i = head_loss(i - 1, hh, teacher[1][i - 1], None, mask)
    else:
      loss_i = head_loss(i - 1, hh, None, teacher[1][i - 1], mask)
    head_losses.append(loss_i)
  head_losses = jnp.stack(head_losses)
  return trunk_loss, head_losses


def agreement(m: model_lib.MTPModel, tokens_BW, eod_id: int, start: int = 0, top_k: int = 0):
  """Per head, top-1 agreement with the trunk's own greedy prediction of the same token
  (teacher-forced acceptance proxy), over positions >= start; and the greedy acceptance length
  a step at each position would get with k = K (1 + the run of agreeing heads from head 1).
  top_k > 0: also (hits [K, top_k], trials [K]): how often each rank of a head's candidates is
  the trunk's token (shapes.topk_hits), what a token tree is built from."""
  x_BT = tokens_BW[:, :-1]
  b, t = x_BT.shape
  k = m.heads_cfg.num
  h_BTD, _ = m(x_BT, jnp.broadcast_to(jnp.arange(t), (b, t)))
  trunk_pred = jnp.argmax(m.logits(h_BTD), -1)
  head_logits = m.head_logits(h_BTD, tokens_BW)                    # [B, T, K, V]
  head_pred = jnp.argmax(head_logits, -1)                          # [B, T, K]
  _, mask = head_targets(tokens_BW, k, eod_id)
  mask = mask * (jnp.arange(t) >= start)[None, :, None]
  target_BTK = jnp.stack([shift_along(trunk_pred, i) for i in range(1, k + 1)], -1)
  agree = (head_pred == target_BTK).astype(jnp.float32)
  per_head = jnp.sum(agree * mask, (0, 1)) / jnp.maximum(jnp.sum(mask, (0, 1)), 1.0)
  # Acceptance length only where every head has a target.
  full = mask[..., k - 1]
  run = jnp.sum(jnp.cumprod(agree, axis=-1), -1)
  accept_len = 1.0 + jnp.sum(run * full) / jnp.maximum(jnp.sum(full), 1.0)
  if not top_k:
    return per_head, accept_len
  return per_head, accept_len, shapes.topk_hits(head_logits, target_BTK, mask > 0, top_k)
