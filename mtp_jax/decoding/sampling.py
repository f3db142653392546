"""Logits processors and the verification rules of speculative decoding.

Sampling parameters are per row arrays (temperature [B], top_k [B], top_p [B], repetition
penalty [B]), so a batch mixes greedy and sampled rows and changing them never recompiles. The
same processing is applied to the trunk's (target) and the heads' (draft) logits.

Verification, for drafts d_1..d_k and the trunk's distributions p_0..p_k over the k+1 verified
positions (p_{i-1} is the trunk's distribution for the token d_i claims):
  greedy    accept the longest prefix with d_i == argmax p_{i-1}; the trunk adds argmax p_n.
  sampling  accept d_i with probability min(1, p_{i-1}(d_i) / q_i(d_i)); at the first rejection
            draw from norm(max(0, p_{i-1} - q_i)); if all k are accepted draw from p_k. The emitted
            tokens are then distributed exactly as sampling from p alone (Leviathan et al. 2023).
A greedy row inside a sampling batch is processed into one-hot distributions, for which the
sampling rule reduces exactly to the greedy rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

NEG_INF = -1e30


@struct.dataclass
class SamplingParams:
  """Per row: its PRNG key (a row's stream ignores the other rows) and its logits processors."""
  key: jax.Array           # [B] one PRNG key per row
  temperature: jax.Array   # [B] f32, 0 = greedy
  top_k: jax.Array         # [B] int32, 0 = off
  top_p: jax.Array         # [B] f32, 1 = off
  penalty: jax.Array       # [B] f32 repetition penalty, 1 = off

  @property
  def processors(self):
    """(temperature, top_k, top_p, penalty): process_logits' per-row arguments."""
    return self.temperature, self.top_k, self.top_p, self.penalty


def init_params(key_B, b: int) -> SamplingParams:
  """b greedy rows with these keys."""
  return SamplingParams(key=key_B, temperature=jnp.zeros((b,), jnp.float32),
                        top_k=jnp.zeros((b,), jnp.int32), top_p=jnp.ones((b,), jnp.float32),
                        penalty=jnp.ones((b,), jnp.float32))


def presence(tokens_BS, length_B, vocab_size: int):
  """[B, V] bool: which tokens occur in each row's first length_B tokens."""
  b, s = tokens_BS.shape
  valid = jnp.arange(s)[None] < length_B[:, None]
  return jnp.zeros((b, vocab_size), bool).at[jnp.arange(b)[:, None], tokens_BS].max(valid)


def penalize(logits_BxV, penalty_B, presence_BxV):
  """Repetition penalty (CTRL, as in HF transformers): logits of tokens already present are
  divided by the penalty when positive and multiplied by it when negative; 1.0 is off."""
  pen = penalty_B.reshape((-1,) + (1,) * (logits_BxV.ndim - 1))
  hit = jnp.where(logits_BxV > 0, logits_BxV / pen, logits_BxV * pen)
  return jnp.where(presence_BxV, hit, logits_BxV)


def process_logits(logits_BxV, temperature_B, top_k_B, top_p_B, penalty_B=None,
                   presence_BxV=None):
  """-> log-probabilities [B, ..., V] of the processed distribution, in f32.

  The repetition penalty (if given) applies first, then temperature 0 gives a one-hot
  distribution on the argmax; top_k 0 and top_p 1 disable those filters. Extra axes between B
  and V (positions) share their row's parameters.
  """
  logits = logits_BxV.astype(jnp.float32)
  if penalty_B is not None:
    logits = penalize(logits, penalty_B, presence_BxV)
  extra = (1,) * (logits.ndim - 2)
  t = temperature_B.reshape((-1,) + extra + (1,))
  k = top_k_B.reshape((-1,) + extra + (1,))
  p = top_p_B.reshape((-1,) + extra + (1,))
  greedy = t <= 0
  scaled = logits / jnp.where(greedy, 1.0, t)
  v = logits.shape[-1]
  sorted_desc = -jnp.sort(-scaled, axis=-1)
  # top-k: keep logits >= the k-th largest.
  kth = jnp.take_along_axis(sorted_desc, jnp.clip(k - 1, 0, v - 1).astype(jnp.int32), axis=-1)
  keep = jnp.where(k > 0, scaled >= kth, True)
  # top-p: keep the smallest prefix of sorted tokens whose mass reaches p (always the first).
  probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
  mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
  cutoff_idx = jnp.sum(mass_before < p, axis=-1, keepdims=True) - 1
  cutoff = jnp.take_along_axis(sorted_desc, jnp.clip(cutoff_idx, 0, v - 1), axis=-1)
  keep &= jnp.where(p < 1.0, scaled >= cutoff, True)
  filtered = jnp.where(keep, scaled, NEG_INF)
  one_hot = jnp.where(jnp.arange(v) == argmax(logits)[..., None], 0.0, NEG_INF)
  return jax.nn.log_softmax(jnp.where(greedy, one_hot, filtered), axis=-1)


def argmax(x_XV):
  """The first index of the largest value over the last axis, as jnp.argmax (int32).

  XLA:CPU lowers jnp.argmax to a variadic (value, index) reduction that runs several times
  slower than a max followed by a min over the matching indices: [1, 4, 4096] logits took
  189 us against 25 us, [64, 4, 4096] 6.8 ms against 1.0 ms (median of 12 interleaved repeats).
  Every greedy step takes one per verified position and per draft."""
  v = x_XV.shape[-1]
  hit = x_XV == jnp.max(x_XV, axis=-1, keepdims=True)
  first = jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
  return jnp.minimum(first, v - 1)   # a row of NaN matches nothing


def row_keys(key, b: int):
  """Per-row keys [b]: `key` itself when it already is one key per row, else b keys split
  from it. Per-row keys make a row's random stream independent of the rest of the batch."""
  if key.ndim == 1 and key.shape[0] == b:
    return key
  return jax.random.split(key, b)


def split_rows(keys_B, num: int):
  """[B] keys -> [B, num] keys (each row's key split num ways)."""
  return jax.vmap(lambda k: jax.random.split(k, num))(keys_B)


def sample(key, logp_BxV):
  """One token per row from log-probabilities [B, V] (or [B, P, V]); `key` is one key or one
  per row."""
  keys = row_keys(key, logp_BxV.shape[0])
  return jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(keys, logp_BxV).astype(
      jnp.int32)


def verify_greedy(drafts_BK, target_logits_BKV, k_row_B=None):
  """-> (accepted count n [B], emitted tokens [B, k+1]; the first n+1 are valid).

  k_row_B (optional) verifies only each row's first k_row drafts (a row's chain cut early).
  """
  target = argmax(target_logits_BKV)                                # [B, k+1]
  k = drafts_BK.shape[1]
  match = drafts_BK == target[:, :k]
  if k_row_B is not None:
    match &= jnp.arange(k)[None] < k_row_B[:, None]
  n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
  return n, target


def verify_sampling(key, drafts_BK, draft_logq_BKV, target_logp_BKV, k_row_B=None):
  """Lossless rejection sampling. target_logp has k+1 positions; draft_logq has k; `key` is one
  key or one per row.

  -> (accepted count n [B], emitted tokens [B, k+1]; the first n+1 are valid).
  k_row_B (optional) verifies only each row's first k_row drafts: at position k_row the extra
  token is drawn from p itself, as if the row had drafted k_row tokens, so it stays lossless.
  """
  b, k = drafts_BK.shape
  ks = split_rows(row_keys(key, b), 2)
  k_u, k_s = ks[:, 0], ks[:, 1]
  p = jnp.exp(target_logp_BKV)                                          # [B, k+1, V]
  if k == 0:
    return jnp.zeros((b,), jnp.int32), sample(k_s, target_logp_BKV)
  q = jnp.exp(draft_logq_BKV)                                           # [B, k, V]
  p_d = jnp.take_along_axis(p[:, :k], drafts_BK[..., None], -1)[..., 0]
  q_d = jnp.take_along_axis(q, drafts_BK[..., None], -1)[..., 0]
  u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(k_u)
  # u < p/q  <=>  u * q < p  (no division; q_d > 0 for a sampled draft).
  accept = u * q_d < p_d
  if k_row_B is not None:
    accept &= jnp.arange(k)[None] < k_row_B[:, None]
  n = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)
  residual = jnp.maximum(p[:, :k] - q, 0.0)
  mass = jnp.sum(residual, -1, keepdims=True)
  # Where p <= q everywhere (p == q), a rejection cannot happen; fall back to p for safety.
  residual = jnp.where(mass > 0, residual / jnp.maximum(mass, 1e-30), p[:, :k])
  if k_row_B is not None:       # positions at or past a row's cut were never drafted: use p
    residual = jnp.where((jnp.arange(k)[None] >= k_row_B[:, None])[..., None], p[:, :k], residual)
  correction = jnp.concatenate([residual, p[:, k:]], axis=1)            # [B, k+1, V]
  # The extra token is drawn at each row's position n alone: one V-sized draw a row, not k+1.
  at_n = jnp.take_along_axis(correction, n[:, None, None], axis=1)[:, 0]    # [B, V]
  extra = sample(k_s, jnp.log(jnp.maximum(at_n, 1e-38)) + jnp.where(at_n > 0, 0.0, NEG_INF))
  tokens = jnp.concatenate([drafts_BK, jnp.zeros((b, 1), jnp.int32)], axis=1)
  idx = jnp.arange(k + 1)[None]
  tokens = jnp.where(idx == n[:, None], extra[:, None], tokens)
  return n, tokens
