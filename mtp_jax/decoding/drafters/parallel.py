"""Parallel heads (Medusa / Gloeckle et al.): head i reads the trunk's hidden state at the last
accepted position and predicts the token i + 1 past it; all heads in one einsum and one
unembedding. No cache of their own.

Their hidden states depend on the trunk's alone, so a step may run them at every position it
verifies and unembed them in the trunk's own product, one pass over the unembedding instead of
two, then keep the accepted position's logits (Medusa does so; step.py `_logits` decides where
it pays): `draft` reads them from DraftInput.head_logits_BTNV where the step made them."""

from __future__ import annotations

import jax.numpy as jnp

from mtp_jax.decoding import sampling, tree_verify
from mtp_jax.decoding.drafters.base import DraftInput, DraftSpec, no_drafts, peak_prob


class ParallelHeads:
  one_pass = True           # the step may unembed the heads with the trunk (step._logits)

  def __init__(self, spec: DraftSpec):
    self.spec = spec

  def init_cache(self, b: int, s: int):
    return None, None

  def prefill(self, m, dm, tokens_NP, length_N, h_NPD, hist_NS, key, sp, presence_NV,
              sample: bool):
    h_last = jnp.take_along_axis(h_NPD, (length_N - 1)[:, None, None], axis=1)[:, 0]
    return self.heads(m, h_last, key, sp, presence_NV, sample, self.spec.kd) + (None, None)

  def draft(self, m, dm, inp: DraftInput, n: int, sample: bool, want_conf: bool,
            ranked: bool = True):
    logits = None
    if inp.head_logits_BTNV is not None:       # made in the trunk's product: the accepted row's
      last = inp.n_B if inp.last_B is None else inp.last_B
      logits = jnp.take_along_axis(inp.head_logits_BTNV, last[:, None, None, None],
                                   axis=1)[:, 0, :n]
    return self.heads(m, inp.h_last_BD, inp.key, inp.sp, inp.presence_BV, sample, n,
                      want_conf, ranked, logits) + (inp.draft_cache, inp.seq_h)

  def heads(self, m, h_BD, key, sp, presence_BV, sample: bool, n: int, want_conf: bool = True,
            ranked: bool = True, logits=None):
    """n drafts from the first n heads at one hidden state per row (or from their logits
    [B, n, V], made by the step) -> (drafts [B, n], logq [B, n, V], the heads' confidence: peak
    probability [B, n]); with
    spec.top_r and `ranked`, each head's top_r candidates [B, n, R] (candidates).

    When sampling, draft i is drawn from head i's processed distribution, whose repetition
    penalty also counts drafts 1..i-1 (the history the trunk will verify it against).
    """
    b, v = h_BD.shape[0], self.spec.vocab_size
    if n == 0:
      return no_drafts(b, v)
    if logits is None:
      hh = m.head_hidden(h_BD[:, None], n=n)[:, 0]                      # [B, n, D]
      logits = m.head_unembed(hh)                                       # [B, n, V]
    if self.spec.top_r and ranked:
      return self.candidates(logits, key, sp, presence_BV, sample, want_conf)
    if not sample:
      # Confidences feed only the controller and the threshold: the softmax is skipped where
      # neither reads it.
      c = self.spec.conf_cols(n, want_conf)
      conf_BN = jnp.zeros((b, n), jnp.float32)
      if c:
        conf_BN = conf_BN.at[:, :c].set(peak_prob(logits[:, :c]))
      return (sampling.argmax(logits), jnp.zeros((b, n, v), jnp.float32),
              conf_BN)
    drafts, logqs = [], []
    subs = sampling.split_rows(key, self.spec.kd)                       # [B, Kd] row keys
    for i in range(n):
      logq = sampling.process_logits(logits[:, i], *sp, presence_BV)
      d = sampling.sample(subs[:, i], logq)
      presence_BV = presence_BV.at[jnp.arange(b), d].set(True)
      drafts.append(d)
      logqs.append(logq)
    drafts, logq = jnp.stack(drafts, 1), jnp.stack(logqs, 1)
    # The confidence is the peak of the head's distribution, not q(d_i): a cut that depended on
    # the sampled draft itself would bias the output (rejection sampling assumes d_i ~ q_i).
    return drafts, logq, jnp.exp(jnp.max(logq, -1))

  def candidates(self, logits_BNV, key, sp, presence_BV, sample: bool, want_conf: bool = True):
    """A tree engine's drafts: each head's top_r candidates by rank [B, n, R] (-> drafts, logq
    [B, n, V], the heads' peak probability [B, n]).

    Greedy: the heads' best tokens (tree_verify mode 'topk'). Sampling: drawn without
    replacement from each head's processed q (mode 'sampled'), the penalty counting the row's
    history alone: a tree's branches would add different drafts to it, and verification reads
    exactly the q the draws came from (Drafts.logq), so any q stays lossless.
    """
    b, n, v = logits_BNV.shape
    if not sample:
      conf_BN = jnp.zeros((b, n), jnp.float32)
      c = self.spec.conf_cols(n, want_conf)
      if c:                                      # adaptive k reads the first head's
        conf_BN = conf_BN.at[:, :c].set(peak_prob(logits_BNV[:, :c]))
      return (tree_verify.topk_candidates(logits_BNV, self.spec.top_r),
              jnp.zeros((b, n, v), jnp.float32), conf_BN)
    logq = sampling.process_logits(logits_BNV, *sp, presence_BV[:, None])
    return (tree_verify.draw_candidates(key, logq, self.spec.top_r), logq,
            jnp.exp(jnp.max(logq, -1)))
