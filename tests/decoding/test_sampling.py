"""Logits processors and the verification rules, on hand-made distributions."""

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.decoding import sampling as S


def _row(x):
  return jnp.asarray(x, jnp.float32)[None]


def test_process_logits_filters():
  logits = _row([[3.0, 2.0, 1.0, 0.0, -1.0]])          # [1, 1, 5]
  one = lambda t, k, p: np.exp(np.asarray(S.process_logits(
      logits, jnp.array([t], jnp.float32), jnp.array([k]), jnp.array([p], jnp.float32))))[0, 0]
  np.testing.assert_allclose(one(0.0, 0, 1.0), [1, 0, 0, 0, 0])
  full = np.exp([3.0, 2, 1, 0, -1]) / np.exp([3.0, 2, 1, 0, -1]).sum()
  np.testing.assert_allclose(one(1.0, 0, 1.0), full, rtol=1e-5)
  top2 = one(1.0, 2, 1.0)
  np.testing.assert_allclose(top2, np.r_[full[:2] / full[:2].sum(), 0, 0, 0], rtol=1e-5)
  # top-p 0.7: 0.636 < 0.7, so the first two tokens are kept.
  np.testing.assert_allclose(one(1.0, 0, 0.7), top2, rtol=1e-5)
  np.testing.assert_allclose(one(1.0, 0, 0.5), [1, 0, 0, 0, 0], atol=1e-6)
  hot = one(0.5, 0, 1.0)
  np.testing.assert_allclose(hot, np.exp([6.0, 4, 2, 0, -2]) / np.exp([6.0, 4, 2, 0, -2]).sum(),
                             rtol=1e-5)


def test_per_row_parameters():
  logits = jnp.tile(_row([[3.0, 2.0, 1.0, 0.0]]), (3, 1, 1))
  lp = S.process_logits(logits, jnp.array([0.0, 1.0, 1.0]), jnp.array([0, 0, 1]),
                        jnp.array([1.0, 1.0, 1.0]))
  p = np.exp(np.asarray(lp))[:, 0]
  assert p[0, 0] == 1 and p[2, 0] == 1 and 0 < p[1, 0] < 1


def test_greedy_verify_accepts_the_matching_prefix():
  target = jax.nn.one_hot(jnp.array([[5, 6, 7, 8]]), 10) * 10   # argmax 5, 6, 7, 8
  n, out = S.verify_greedy(jnp.array([[5, 6, 1]]), target)
  assert int(n[0]) == 2 and out[0].tolist() == [5, 6, 7, 8]
  n, _ = S.verify_greedy(jnp.array([[4, 6, 7]]), target)
  assert int(n[0]) == 0


def test_rejection_rule_matches_the_closed_form():
  """With d_1 ~ q, the first emitted token is distributed as p, and P(accept) = sum min(p, q);
  the second position, reached only after an acceptance, is distributed as p_1."""
  p0 = np.array([0.5, 0.2, 0.2, 0.1, 0.0])
  p1 = np.array([0.1, 0.1, 0.6, 0.1, 0.1])
  q1 = np.array([0.1, 0.6, 0.1, 0.1, 0.1])
  n_samples = 200_000
  key = jax.random.key(0)
  k_d, k_v = jax.random.split(key)
  log = lambda x: jnp.log(jnp.maximum(jnp.asarray(x, jnp.float32), 1e-38)) + jnp.where(
      jnp.asarray(x) > 0, 0.0, S.NEG_INF)
  drafts = jax.random.categorical(k_d, log(q1), shape=(n_samples, 1)).astype(jnp.int32)
  logq = jnp.broadcast_to(log(q1), (n_samples, 1, 5))
  logp = jnp.broadcast_to(jnp.stack([log(p0), log(p1)]), (n_samples, 2, 5))
  n, out = jax.jit(S.verify_sampling)(k_v, drafts, logq, logp)
  n, out = np.asarray(n), np.asarray(out)
  sigma = lambda p: 4.5 * np.sqrt(p * (1 - p) / n_samples) + 1e-4
  freq0 = np.bincount(out[:, 0], minlength=5) / n_samples
  assert np.all(np.abs(freq0 - p0) <= sigma(p0)), (freq0, p0)
  acc = np.minimum(p0, q1).sum()
  assert abs(n.mean() - acc) <= sigma(acc)
  sel = out[n == 1, 1]
  freq1 = np.bincount(sel, minlength=5) / len(sel)
  assert np.all(np.abs(freq1 - p1) <= 4.5 * np.sqrt(p1 * (1 - p1) / len(sel)) + 1e-4)
  assert freq0[4] == 0                      # a token p gives no mass is never emitted


def test_sampling_rule_on_one_hot_rows_is_the_greedy_rule():
  target = jax.nn.one_hot(jnp.array([[5, 6, 7]]), 10)
  logp = jnp.log(jnp.maximum(target, 1e-38)) + jnp.where(target > 0, 0.0, S.NEG_INF)
  drafts = jnp.array([[5, 2]])
  logq = jnp.log(jnp.maximum(jax.nn.one_hot(drafts, 10), 1e-38))
  logq = logq + jnp.where(jax.nn.one_hot(drafts, 10) > 0, 0.0, S.NEG_INF)
  for seed in range(5):
    n, out = S.verify_sampling(jax.random.key(seed), drafts, logq, logp)
    assert int(n[0]) == 1 and out[0, :2].tolist() == [5, 6]


def test_argmax_equals_jnp_argmax_first_index_on_ties():
  x = jax.random.normal(jax.random.key(3), (5, 3, 257))
  x = x.at[0, 0, 7].set(9.0).at[0, 0, 200].set(9.0)    # a tie: the first index wins
  x = x.at[1, 2].set(0.0)                               # all equal
  got = S.argmax(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, -1)))
  assert int(got[0, 0]) == 7 and int(got[1, 2]) == 0
