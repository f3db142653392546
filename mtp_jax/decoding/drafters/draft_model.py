"""Classic speculative decoding's drafter: a separate, smaller model of the same vocabulary with
its own KV cache, drafting one token per forward pass."""

from __future__ import annotations

import jax.numpy as jnp

from mtp_jax.decoding import sampling
from mtp_jax.decoding.drafters.base import DraftInput, DraftSpec, no_drafts, pick
from mtp_jax.models import cache as kv


class DraftModel:
  def __init__(self, spec: DraftSpec, model_cfg, cache_args: tuple):
    """cache_args: kv.init_cache's storage arguments (dtype, attention, block), the trunk's."""
    self.spec, self.model_cfg, self.cache_args = spec, model_cfg, cache_args

  def init_cache(self, b: int, s: int):
    return kv.init_cache(self.model_cfg, b, s, *self.cache_args), None

  def prefill(self, m, dm, tokens_NP, length_N, h_NPD, hist_NS, key, sp, presence_NV,
              sample: bool):
    """The draft model over the prompt (room for the first token and the drafts after it),
    then the first drafts."""
    n, p = tokens_NP.shape
    cache = kv.init_cache(self.model_cfg, n, p + self.spec.kd + 1, *self.cache_args)
    _, cache = dm(tokens_NP, jnp.broadcast_to(jnp.arange(p), (n, p)), cache)
    if self.spec.kd == 0:
      return no_drafts(n, self.spec.vocab_size) + (cache, None)
    return self.chain(dm, hist_NS, length_N + 1, cache, key, sp, presence_NV, sample,
                      self.spec.kd) + (None,)

  def draft(self, m, dm, inp: DraftInput, n: int, sample: bool, want_conf: bool,
            ranked: bool = False):
    return self.chain(dm, inp.tokens_BS, inp.length_B, inp.draft_cache, inp.key, inp.sp,
                      inp.presence_BV, sample, n, want_conf) + (inp.seq_h,)

  def chain(self, dm, tokens_BS, length_B, cache, key, sp, presence_BV, sample: bool, n: int,
            want_conf: bool = True):
    """The draft model runs the last two committed tokens (positions L-2, L-1: the one before
    may be a draft it never saw), then one token per further draft.
    -> (drafts [B, n], logq, conf, cache)."""
    pos = (length_B - 2)[:, None] + jnp.arange(2)[None]
    inp = jnp.take_along_axis(tokens_BS, pos, axis=1)
    h, cache = dm(inp, pos, cache)
    logits = dm.logits(h[:, -1])
    subs = sampling.split_rows(key, self.spec.kd)
    drafts, logqs, confs = [], [], []
    for i in range(n):
      d, logq, conf, presence_BV = pick(logits, subs, i, sp, presence_BV, sample,
                                        i < self.spec.conf_cols(n, want_conf))
      drafts.append(d)
      logqs.append(logq)
      confs.append(conf)
      if i + 1 < n:
        p1 = (length_B + i)[:, None]
        h, cache = dm(d[:, None], p1, cache)
        logits = dm.logits(h[:, 0])
    return jnp.stack(drafts, 1), jnp.stack(logqs, 1), jnp.stack(confs, 1), cache
