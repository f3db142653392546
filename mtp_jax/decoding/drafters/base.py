"""What every drafter shares: its static description, the inputs a step hands it, and the pick
of one draft from a drafter's logits.

A drafter proposes the next step's drafts from what the step hands it (DraftInput) and returns
them as (drafts [B, n], logq [B, n, V], conf [B, n], draft cache, seq_h): logq is the processed
log-probability the draft was sampled from (zeros when greedy: only sampled verification reads
q), conf its confidence (the peak probability), read by the controller and the confidence
threshold. The step does not know which drafter it calls.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from mtp_jax.decoding import sampling


@dataclasses.dataclass(frozen=True)
class DraftSpec:
  """Static facts of a drafter's engine."""
  kd: int                   # drafts per step at most (K_max)
  vocab_size: int
  conf_threshold: float     # decode.confidence_threshold (0: off)
  needs_conf: bool          # the controller or the threshold reads confidences
  top_r: int = 0            # a tree engine: candidates per head by rank (drafts [B, n, R]);
                            # 0: one draft per head

  def conf_cols(self, n: int, want_conf: bool = True) -> int:
    """How many of n greedy drafts need a confidence: all of them for the threshold's cut; only
    the first for the controller alone (it reads later positions off the ring), and only where
    it may read them (want_conf: in the adaptive loop, drafting steps and a probe); none
    otherwise."""
    if self.conf_threshold > 0:
      return n
    return min(n, 1) if self.needs_conf and want_conf else 0


class DraftInput(NamedTuple):
  """What a step hands its drafter after verification and commit."""
  h_BTD: jax.Array          # [B, k+1, D] the trunk's hidden states at the verified positions
                            # (a tree step: [B, T+1, D], at the root and every node)
  n_B: jax.Array            # [B] drafts accepted
  tokens_BS: jax.Array      # [B, S] the committed buffer (this step's tokens written)
  start_B: jax.Array        # [B] the length before the step
  length_B: jax.Array       # [B] the committed length after it
  active_B: jax.Array       # [B] bool: rows that took part in the step
  k: int                    # drafts the step verified
  draft_cache: object       # the drafter's cache (Caches.draft), or None
  seq_h: jax.Array | None   # Caches.seq_h
  key: jax.Array            # [B] the rows' drafting keys
  sp: tuple                 # (temperature, top_k, top_p, penalty) per row
  presence_BV: jax.Array | None   # sampled steps: the history the penalty counts
  last_B: jax.Array | None = None  # a tree step: the input of the last accepted token (0 the
                                   # root, i+1 node i); a chain's is n_B
  head_logits_BTNV: jax.Array | None = None  # the first n heads' logits at every verified
                                             # position, where the step computed them in its
                                             # own unembedding product (one pass over [D, V])

  @property
  def h_last_BD(self):
    """The trunk's hidden state at the last accepted position."""
    last = self.n_B if self.last_B is None else self.last_B
    return jnp.take_along_axis(self.h_BTD, last[:, None, None], axis=1)[:, 0]


def peak_prob(logits_XV):
  """The largest probability of softmax(logits) over the last axis, 1 / sum(exp(l - max l)):
  one pass of exp, no normalised distribution."""
  x = logits_XV.astype(jnp.float32)
  return 1.0 / jnp.sum(jnp.exp(x - jnp.max(x, -1, keepdims=True)), -1)


def pick(logits_BV, subs, i: int, sp, presence_BV, sample: bool, want_conf: bool):
  """One draft of an autoregressive drafter (draft model, sequential heads) from its logits:
  sampled from the processed distribution (the drafts so far join the penalty's history),
  or the argmax. -> (draft, logq (zeros when greedy), confidence, presence)."""
  b, v = logits_BV.shape
  if sample:
    logq = sampling.process_logits(logits_BV, *sp, presence_BV)
    d = sampling.sample(subs[:, i], logq)
    return d, logq, jnp.exp(jnp.max(logq, -1)), presence_BV.at[jnp.arange(b), d].set(True)
  conf = peak_prob(logits_BV) if want_conf else jnp.zeros((b,), jnp.float32)
  return (sampling.argmax(logits_BV), jnp.zeros((b, v), jnp.float32), conf,
          presence_BV)


def no_drafts(b: int, v: int):
  """(drafts, logq, conf) of zero drafts."""
  return (jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, v), jnp.float32),
          jnp.zeros((b, 0), jnp.float32))


def history(tokens_NP, length_N, first_N, kd: int):
  """[N, P + Kd + 1] a prefilled row's committed tokens, its first generated token included,
  with room for one step: what the drafters that read tokens draft from at prefill."""
  n, p = tokens_NP.shape
  hist = jnp.zeros((n, p + kd + 1), jnp.int32).at[:, :p].set(tokens_NP)
  return hist.at[jnp.arange(n), length_N].set(first_N)
