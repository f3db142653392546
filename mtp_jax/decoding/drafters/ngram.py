"""Prompt lookup: the latest earlier occurrence of the row's last n tokens in its history, and
the Kd tokens that followed it. No model, no cache; deterministic drafts (q is one-hot on them),
so sampled verification stays exact."""

from __future__ import annotations

import jax.numpy as jnp

from mtp_jax.decoding import sampling
from mtp_jax.decoding.drafters.base import DraftInput, DraftSpec


class NGram:
  def __init__(self, spec: DraftSpec, n: int):
    self.spec, self.n = spec, n

  def init_cache(self, b: int, s: int):
    return None, None

  def prefill(self, m, dm, tokens_NP, length_N, h_NPD, hist_NS, key, sp, presence_NV,
              sample: bool):
    return self.lookup(hist_NS, length_N + 1, sample) + (None, None)

  def draft(self, m, dm, inp: DraftInput, n: int, sample: bool, want_conf: bool,
            ranked: bool = False):
    # Lookup costs nothing: always Kd drafts.
    return self.lookup(inp.tokens_BS, inp.length_B, sample) + (inp.draft_cache, inp.seq_h)

  def lookup(self, tokens_BS, length_B, sample: bool):
    """-> (drafts [B, Kd], logq, conf): conf is 1 where a match was found, else 0."""
    n, kd, v = self.n, self.spec.kd, self.spec.vocab_size
    b, s = tokens_BS.shape
    last = jnp.take_along_axis(tokens_BS, jnp.maximum(length_B - n, 0)[:, None] + jnp.arange(n),
                               axis=1)                                  # [B, n]
    w = s - n
    eq = jnp.ones((b, w), bool)
    for i in range(n):
      eq &= tokens_BS[:, i: i + w] == last[:, i: i + 1]
    j = jnp.arange(w)[None]
    ok = eq & (j < (length_B - n)[:, None])          # the match ends before the suffix itself
    found = jnp.any(ok, 1) & (length_B > n)
    best = jnp.max(jnp.where(ok, j, -1), 1)
    idx = jnp.clip(best[:, None] + n + jnp.arange(kd)[None], 0, s - 1)
    drafts = jnp.take_along_axis(tokens_BS, idx, axis=1)
    conf = jnp.broadcast_to(found[:, None], (b, kd)).astype(jnp.float32)
    logq = (jnp.where(jnp.arange(v) == drafts[..., None], 0.0, sampling.NEG_INF)
            if sample else jnp.zeros((b, kd, v), jnp.float32))
    return drafts, logq, conf
