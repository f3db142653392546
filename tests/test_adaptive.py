"""The adaptive controller: synthetic costs and acceptance, the ring statistics, and k changing
between steps without recompiles or any change of the output."""

import contextlib
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import adaptive as A
from mtp_jax import api
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import engine as E
from mtp_jax import ring as ring_lib
from mtp_jax import tables as T
from mtp_jax.config import DecodeConfig
from tests.conftest import tiny_config


def _controller(state, **values):
  """state with controller fields replaced."""
  return state.replace(controller=state.controller.replace(**values))


def _choose(cost, alpha, active=None):
  alpha = jnp.asarray(alpha, jnp.float32)
  active = jnp.ones(alpha.shape[:1], bool) if active is None else jnp.asarray(active)
  return int(A.choose_k(jnp.asarray(cost, jnp.float32), A.expected_emitted(alpha, active)))


def test_picks_zero_when_drafting_cannot_pay():
  # Verification cost grows with k as fast as compute-bound decoding: k+1 tokens cost k+1 steps.
  assert _choose([1.0, 2.0, 3.0, 4.0], np.full((64, 3), 0.9)) == 0
  # Nearly free verification but heads never right.
  assert _choose([1.0, 1.01, 1.02, 1.03], np.zeros((4, 3))) == 0


def test_picks_k_max_when_verification_is_free_and_acceptance_high():
  assert _choose([1.0, 1.01, 1.02, 1.03], np.full((4, 3), 0.9)) == 3


def test_drafting_must_beat_plain_decoding_by_the_margin():
  # k=1 is expected to be 3% faster than plain decoding: taken without a margin, not with 5%.
  cost, alpha = [1.0, 1.5, 3.0, 4.0], np.full((4, 3), 0.545)
  assert _choose(cost, alpha) == 1
  e = A.expected_emitted(jnp.asarray(alpha, jnp.float32), jnp.ones((4,), bool))
  assert int(A.choose_k(jnp.asarray(cost), e, 0.05)) == 0
  assert int(A.choose_k(jnp.asarray(cost), e, 0.02)) == 1
  rem = jnp.array([50, 50, 50, 50])
  assert int(A.choose_k_to_finish(jnp.asarray(cost), jnp.asarray(alpha), jnp.ones((4,), bool),
                                  rem)) == 1
  assert int(A.choose_k_to_finish(jnp.asarray(cost), jnp.asarray(alpha), jnp.ones((4,), bool),
                                  rem, 0.05)) == 0


def test_argmax_matches_brute_force():
  rng = np.random.default_rng(0)
  for _ in range(200):
    k_max = int(rng.integers(1, 5))
    b = int(rng.integers(1, 9))
    alpha = rng.uniform(0, 1, (b, k_max))
    active = rng.uniform(size=b) < 0.8
    cost = np.cumsum(rng.uniform(0.01, 1.0, k_max + 1))
    best, best_k = -1, None
    for k in range(k_max + 1):
      e = sum(1 + sum(np.prod(alpha[r, :j + 1]) for j in range(k)) for r in range(b) if active[r])
      if e / cost[k] > best + 1e-9:
        best, best_k = e / cost[k], k
    assert _choose(cost, alpha, active) == best_k


@pytest.mark.slow
def test_only_the_k_that_can_pay_are_kept():
  assert A.viable_ks([1.0, 2.0, 3.0, 4.0]) == (0,)           # compute bound: k+1 tokens, k+1 steps
  assert A.viable_ks([1.0, 1.01, 1.02, 1.03]) == (0, 1, 2, 3)
  assert A.viable_ks([1.0, 1.5, 3.5, 3.7], 0.05) == (0, 1, 3)
  assert A.viable_ks([1.0, 1.95, 2.8], 0.05) == (0, 2)        # k=1: 2/1.95 beats 1 by < 5%
  # Exact: under any acceptance (all accepted included), neither objective picks another k.
  rng = np.random.default_rng(1)
  for _ in range(300):
    k_max, b = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    cost = np.cumsum(rng.uniform(0.01, 1.5, k_max + 1)).astype(np.float32)
    margin = float(rng.choice([0.0, 0.05]))
    alpha = rng.uniform(0.5, 1, (b, k_max)) ** rng.choice([1, 8])
    alpha[rng.uniform(size=b) < 0.3] = 1.0
    active = rng.uniform(size=b) < 0.8
    ks = A.viable_ks(cost, margin)
    c, a, act = jnp.asarray(cost), jnp.asarray(alpha, jnp.float32), jnp.asarray(active)
    assert int(A.choose_k(c, A.expected_emitted(a, act), margin)) in ks
    rem = jnp.asarray(rng.integers(1, 100, b))
    assert int(A.choose_k_to_finish(c, a, act, rem, margin)) in ks
    sd = A.row_sd(a, jnp.zeros_like(a))
    assert int(A.choose_k_to_finish(c, a, act, rem, margin, sd_BK=sd)) in ks
    assert int(A.choose_k(c, A.expected_emitted(jnp.ones_like(a), act), margin)) in ks


def _finish_brute_force(cost, alpha, active, rem, sd):
  """The expected finish of the last row for each k, over choose_k_to_finish's fixed draws."""
  z = A.finish_draws(alpha.shape[0])
  t = np.zeros(len(cost))
  for s in range(A.FINISH_DRAWS):
    a = np.clip(alpha + z[s][:, None] * sd, 0, 1)
    for k in range(len(cost)):
      t[k] += max([0.0] + [rem[r] / (1 + sum(np.prod(a[r, :j + 1]) for j in range(k))) * cost[k]
                           for r in range(len(rem)) if active[r]]) / A.FINISH_DRAWS
  return t


def test_the_end_of_a_job_weighs_the_rows_uncertain_rates():
  # One draft at 1.5x a plain step; a row accepting 60% is expected to emit 1.6 tokens a step.
  cost = jnp.asarray([1.0, 1.5])
  for b in (1, 16):
    alpha, act, rem = jnp.full((b, 1), 0.6), jnp.ones((b,), bool), jnp.full((b,), 40)
    few, many = A.row_sd(alpha, jnp.zeros((b, 1))), A.row_sd(alpha, jnp.full((b, 1), 400.0))
    assert int(A.choose_k_to_finish(cost, alpha, act, rem)) == 1
    assert int(A.choose_k_to_finish(cost, alpha, act, rem, sd_BK=many)) == 1
    # Sixteen rows known from no trials of their own: some may well draft worse than 50%, and
    # the last of them sets the end: plain decoding. One such row alone still drafts.
    assert int(A.choose_k_to_finish(cost, alpha, act, rem, sd_BK=few)) == (0 if b > 1 else 1)
  # Each row's draws are the normal's quantiles, in an order of their own.
  z = A.finish_draws(3)
  assert np.allclose(np.sort(z, 0), np.sort(z[:, :1], 0)) and abs(z.mean()) < 1e-6
  assert abs(z[:, 0].std() - 1) < 0.05 and abs(np.corrcoef(z[:, 0], z[:, 1])[0, 1]) < 0.3
  # The uncertainty shrinks with the row's own trials, faster past the first position.
  sd = np.asarray(A.row_sd(jnp.full((1, 2), 0.5), jnp.asarray([[0.0, 0.0]])))
  phi = A.ROW_OVERDISPERSION
  np.testing.assert_allclose(sd, [[np.sqrt(phi * 0.25 / A.ROW_PRIOR_TRIALS),
                                   np.sqrt(phi * 0.25 / A.ROW_PRIOR_TRIALS_LATER)]], rtol=1e-6)
  # The mean over the draws of the last row's finish, against brute force.
  rng = np.random.default_rng(2)
  for _ in range(50):
    b, k_max = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    alpha = rng.uniform(0, 1, (b, k_max)).astype(np.float32)
    act = rng.uniform(size=b) < 0.8
    rem = rng.integers(1, 50, b)
    cost = np.cumsum(rng.uniform(0.01, 1.0, k_max + 1)).astype(np.float32)
    sd = np.asarray(A.row_sd(jnp.asarray(alpha), jnp.asarray(rng.integers(0, 20, (b, k_max)),
                                                               jnp.float32)))
    t = _finish_brute_force(cost, alpha, act, rem, sd)
    got = int(A.choose_k_to_finish(jnp.asarray(cost), jnp.asarray(alpha), jnp.asarray(act),
                                   jnp.asarray(rem), sd_BK=jnp.asarray(sd)))
    assert np.isclose(t[got], min(t), rtol=1e-4), (t, got)


def test_the_end_of_a_job_weighs_the_scatter_of_the_steps_left():
  # What a row realises over h steps scatters around its rate by (overdispersed) binomial noise:
  # the fewer steps left, the wider; with many left, the rate's own uncertainty alone.
  alpha, trials = jnp.full((3, 1), 0.8), jnp.full((3, 1), 48.0)
  sd = np.asarray(A.finish_sd(alpha, trials, jnp.asarray([1, 30, 100000])))[:, 0]
  base = float(A.row_sd(alpha, trials)[0, 0])
  h = 30 / 1.8
  np.testing.assert_allclose(
      sd[1], np.sqrt(base ** 2 + A.ROW_OVERDISPERSION * 0.16 / h), rtol=1e-5)
  assert sd[0] > sd[1] > sd[2] and np.isclose(sd[2], base, rtol=1e-3)
  # The demo model's rows accept ~0.78 of first drafts, and a step of one draft costs 1.4 plain
  # steps at 256 slots: one row drafts, but the last of 256 rows with no counts of their own
  # emits too little for a draft step to pay (whole mtp:1 runs: 99 steps against 127 plain).
  cost = jnp.asarray([1.0, 1.4])
  for b, want in ((1, 1), (256, 0)):
    alpha, act, rem = jnp.full((b, 1), 0.78), jnp.ones((b,), bool), jnp.full((b,), 120)
    sd = A.finish_sd(alpha, jnp.zeros((b, 1)), rem)
    assert int(A.choose_k_to_finish(cost, alpha, act, rem, 0.02, sd_BK=sd)) == want


def test_window_rates_are_conditional_per_position():
  ring = ring_lib.init_ring(4, 2, 3)
  # Step 0: row 0 verified 3, accepted 1; row 1 verified 3, accepted 3.
  ring = ring_lib.record(ring, 0, jnp.zeros((2, 4), jnp.int32), jnp.array([2, 4]),
                         jnp.array([3, 3]), jnp.array([1, 3]), 3, 2, jnp.array([0, 0]))
  # Step 1: row 0 inactive; row 1 verified 2, accepted 0.
  ring = ring_lib.record(ring, 1, jnp.zeros((2, 4), jnp.int32), jnp.array([0, 1]),
                         jnp.array([0, 2]), jnp.array([0, 0]), 2, 1, jnp.array([1, 1]))
  rate, trials = A.window_rates(ring, jnp.asarray(2), 16, 3)
  # position 0: trials 3 (r0s0, r1s0, r1s1), hits 2; position 1: reached by r0s0 (acc>=1) and r1s0
  # -> trials 2, hits 1 (r1s0); position 2: reached by r1s0 only -> 1 trial, 1 hit.
  np.testing.assert_allclose(np.asarray(trials), [3, 2, 1])
  np.testing.assert_allclose(np.asarray(rate), [2 / 3, 1 / 2, 1.0])
  rate, trials = A.window_rates(ring, jnp.asarray(2), 1, 3)       # only the newest step
  np.testing.assert_allclose(np.asarray(trials), [1, 0, 0])


def test_a_rows_warm_up_steps_are_left_out_of_the_window():
  """Drafts are accepted less right after a prompt: the records of a row's first `warmup` steps
  since its insert (Ring.row_step) do not count."""
  ring = ring_lib.init_ring(4, 2, 1)
  z = jnp.zeros((2, 2), jnp.int32)
  # Row 0 was inserted at step 0, row 1 at step 1 (its record of step 0 is its predecessor's).
  ring = ring_lib.record(ring, 0, z, jnp.array([1, 2]), jnp.array([1, 1]), jnp.array([0, 1]), 1,
                         2, jnp.array([0, 30]))
  ring = ring_lib.record(ring, 1, z, jnp.array([2, 1]), jnp.array([1, 1]), jnp.array([1, 0]), 1,
                         2, jnp.array([1, 0]))
  ring = ring_lib.record(ring, 2, z, jnp.array([2, 2]), jnp.array([1, 1]), jnp.array([1, 1]), 1,
                         2, jnp.array([2, 1]))
  for warmup, hits, trials in [(0, [[2], [2]], [[3], [3]]), (1, [[2], [2]], [[2], [2]]),
                               (2, [[1], [1]], [[1], [1]]), (3, [[0], [1]], [[0], [1]])]:
    h, t = A.row_window(ring, jnp.asarray(3), 16, 1, warmup)
    np.testing.assert_allclose(np.asarray(h), hits, err_msg=f"warmup={warmup}")
    np.testing.assert_allclose(np.asarray(t), trials, err_msg=f"warmup={warmup}")


def test_the_controller_does_not_count_a_rows_warm_up():
  """Two rows 12 steps into their generation, one draft per step: rejected in their first 8
  steps, accepted in the next 4. Counting the start, the controller sees 1/3 acceptance and
  decodes plainly (one draft costs 1.5 x plain); leaving it out, it sees 4/4 and drafts."""
  cfg = tiny_config()
  chosen = {}
  for warmup in (0, 8):
    eng = E.Engine(cfg.model, cfg.heads, DecodeConfig(batch_size=2, k=-1, adaptive=True,
                                                      max_len=32, adapt_warmup=warmup), 0)
    kd = eng.kd
    st = eng._init_state_unplaced(cost=[1.0, 1.5] + [1.5 + k for k in range(1, kd)])
    ring = st.record.ring
    z = jnp.zeros((2, kd + 1), jnp.int32)
    for s in range(12):
      acc = jnp.full((2,), int(s >= 8))
      ring = ring_lib.record(ring, s, z, 1 + acc, jnp.ones((2,), jnp.int32), acc, 1, 2,
                             jnp.full((2,), s))
    st = st.replace(record=st.record.replace(ring=ring, step=jnp.asarray(12)),
                    rows=st.rows.replace(steps=jnp.full((2,), 12), done=jnp.zeros((2,), bool),
                                         length=jnp.full((2,), 20), stop_len=jnp.full((2,), 30)),
                    drafts=st.drafts.replace(n_fresh=jnp.full((2,), kd),
                                             conf=jnp.full((2, kd), 0.5)))
    chosen[warmup] = int(eng.choose_k(st, (0, 1)))
  assert chosen == {0: 0, 8: 1}


def test_the_profile_weighs_counts_by_output_position():
  """g per bucket of PROFILE_TOKENS output tokens (the last open-ended); a row's mean g over the
  tokens it has left; the window's trials weigh g where they were made."""
  n, w = A.PROFILE_BUCKETS, A.PROFILE_TOKENS
  profile = jnp.asarray(np.arange(1, n + 1, dtype=np.float32))          # g = bucket + 1
  np.testing.assert_array_equal(np.asarray(A.profile_bucket(jnp.array([0, w - 1, w, 10 * n * w]))),
                                [0, 0, 1, n - 1])
  # Row 0: 8 tokens left from position w - 4, 4 in bucket 0 and 4 in bucket 1 -> (4 + 8) / 8.
  # Row 1: 2w left from the last bucket's start: g there. Row 2: nothing left: g at its position.
  gain = A.future_gain(profile, jnp.array([w - 4, (n - 1) * w, w]), jnp.array([8, 2 * w, 0]))
  np.testing.assert_allclose(np.asarray(gain), [1.5, n, 2.0])
  ring = ring_lib.init_ring(4, 2, 1)
  z = jnp.zeros((2, 2), jnp.int32)
  # Row 0 accepted at positions 0 and w (g 1 and 2); row 1 rejected at position 2w (g 3).
  ring = ring_lib.record(ring, 0, z, jnp.array([2, 1]), jnp.array([1, 1]), jnp.array([1, 0]), 1,
                         2, jnp.array([0, 0]), jnp.array([0, 2 * w]))
  ring = ring_lib.record(ring, 1, z, jnp.array([2, 0]), jnp.array([1, 0]), jnp.array([1, 0]), 1,
                         1, jnp.array([1, 0]), jnp.array([w, 0]))
  h, t = A.row_window(ring, jnp.asarray(2), 16, 1, 0, profile)
  np.testing.assert_allclose(np.asarray(h), [[2], [0]])
  np.testing.assert_allclose(np.asarray(t), [[3], [3]])               # row 0: 1 + 2; row 1: 3
  h, t = A.row_window(ring, jnp.asarray(2), 16, 1)                     # no profile: counts
  np.testing.assert_allclose(np.asarray(t), [[2], [1]])


def test_a_profile_is_learned_from_runs_counts():
  """Each bucket's rate over the whole rate, pulled towards 1 where it has few trials, the
  trials' mean g 1; flat without counts; stored counts are summed and capped."""
  assert T.run_profile([0] * A.PROFILE_BUCKETS, [0] * A.PROFILE_BUCKETS) == \
      [1.0] * A.PROFILE_BUCKETS
  big = 1e6
  t = [big] * A.PROFILE_BUCKETS
  h = [0.5 * big] + [0.8 * big] * (A.PROFILE_BUCKETS - 1)
  g = np.asarray(T.run_profile(t, h))
  whole = np.sum(h) / np.sum(t)
  np.testing.assert_allclose(g, np.asarray(h) / big / whole, rtol=1e-4)
  assert np.mean(g) == pytest.approx(1.0)
  # A bucket without trials gets the whole rate: g = 1 before the normalisation.
  t2, h2 = list(t), list(h)
  t2[-1] = h2[-1] = 0.0
  g2 = np.asarray(T.run_profile(t2, h2))
  assert g2[-1] == pytest.approx(g2[1] * (0.5 + 0.8 * 6) / 7 / 0.8, rel=1e-3)
  assert np.sum(np.asarray(t2) * g2) == pytest.approx(np.sum(t2))
  tm, hm = T.merge_profile_counts(([10.0] * A.PROFILE_BUCKETS, [5.0] * A.PROFILE_BUCKETS),
                                  ([1] * A.PROFILE_BUCKETS, [1] * A.PROFILE_BUCKETS))
  assert tm == [11.0] * A.PROFILE_BUCKETS and hm == [6.0] * A.PROFILE_BUCKETS
  tm, hm = T.merge_profile_counts(None, ([A.PROFILE_KEEP] * A.PROFILE_BUCKETS,
                                         [A.PROFILE_KEEP / 2] * A.PROFILE_BUCKETS))
  assert sum(tm) == pytest.approx(A.PROFILE_KEEP) and hm[0] == pytest.approx(tm[0] / 2)


def test_a_closed_batch_expects_the_acceptance_its_rows_have_ahead():
  """16 rows 12 tokens into their output, their first drafts accepted 0.65 of the time so far
  (what a closed batch of 16 read on the demo model), 100 tokens left, earlier runs' rate 0.78;
  a step of one draft costs 1.42 plain steps. With a flat profile the controller expects about
  0.65 for the rest and decodes plainly; with the demo model's profile (a
  request's first 16 tokens accept 0.8 of its whole rate, later ones up to 1.1) it expects the
  rows to accept more from here on and drafts (whole runs: 84 steps of one draft against 127
  plain)."""
  cfg = tiny_config()
  b = 16
  eng = E.Engine(cfg.model, cfg.heads, DecodeConfig(batch_size=b, k=-1, adaptive=True,
                                                    max_len=cfg.model.max_seq_len,
                                                    adapt_warmup=0), 0)
  kd = eng.kd
  st = eng._init_state_unplaced(cost=[1.0, 1.42] + [1.42 + k for k in range(1, kd)])
  ring = st.record.ring
  z = jnp.zeros((b, kd + 1), jnp.int32)
  for s in range(12):
    acc = jnp.asarray((np.arange(b) + 7 * s) % 20 < 13, jnp.int32)       # 13 in 20 accepted
    ring = ring_lib.record(ring, s, z, 1 + acc, jnp.ones((b,), jnp.int32), acc, 1, b,
                           jnp.full((b,), s), jnp.full((b,), s))
  row_hits = np.asarray(ring.accepted).sum(0).astype(np.float32)
  assert 0.6 < row_hits.sum() / (12 * b) < 0.7
  # The rows' own memory holds the same counts (at g = 0.8 in the demo profile's first bucket).
  own = np.zeros((b, kd), np.float32)
  st = st.replace(record=st.record.replace(ring=ring, step=jnp.asarray(12)),
                  rows=st.rows.replace(steps=jnp.full((b,), 12), done=jnp.zeros((b,), bool),
                                       prompt_len=jnp.full((b,), 4), length=jnp.full((b,), 16),
                                       stop_len=jnp.full((b,), 116)),
                  drafts=st.drafts.replace(n_fresh=jnp.full((b,), kd),
                                           conf=jnp.full((b, kd), 0.5)),
                  controller=st.controller.replace(
                      row_hits=jnp.asarray(own).at[:, 0].set(row_hits),
                      prior_rate=jnp.asarray([0.78] + [-1.0] * (kd - 1)),
                      closed=jnp.asarray(True)))
  chosen = {}
  for name, profile in (("flat", [1.0] * 8), ("demo", [0.8, 0.95, 1.0, 1.0, 1.02, 1.05, 1.09,
                                                      1.08])):
    g = profile[0]
    ctrl = st.controller.replace(profile=jnp.asarray(profile, jnp.float32),
                                 row_trials=jnp.asarray(own).at[:, 0].set(12 * g))
    chosen[name] = int(eng.choose_k(st.replace(controller=ctrl), (0, 1)))
  assert chosen == {"flat": 0, "demo": 1}


def test_cost_table_round_trip(tmp_path):
  path = str(tmp_path / "c.json")
  assert T.load_table(path, "x") is None
  T.save_table(path, "x", [1.0, 2.0])
  T.save_table(path, "y", [3.0])
  assert T.load_table(path, "x") == [1.0, 2.0] and T.load_table(path, "y") == [3.0]


def test_cost_table_key_names_the_runtime(monkeypatch):
  """A table measured under other XLA flags (one thread, say) or on other cores is not reused."""
  cfg = tiny_config()
  eng = E.Engine(cfg.model, cfg.heads, DecodeConfig(batch_size=2, k=-1, adaptive=True,
                                                    max_len=32), 0)
  flags = os.environ.get("XLA_FLAGS")
  key = T.table_key(eng)
  assert f"jax={jax.__version__}" in key and "|cores=" in key
  monkeypatch.setenv("XLA_FLAGS", (flags or "") + " --xla_cpu_multi_thread_eigen=false")
  assert T.table_key(eng) != key
  monkeypatch.undo()
  if hasattr(os, "sched_getaffinity"):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(97)))
    assert "|cores=97|" in T.table_key(eng) and T.table_key(eng) != key
    monkeypatch.undo()
  assert T.table_key(eng) == key


def test_measured_costs_are_made_non_decreasing():
  assert T.monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
  # A k that measured dearer than the next one is averaged with it, not skipped over.
  np.testing.assert_allclose(T.monotone([1.3, 2.1, 3.1, 2.5]), [1.3, 2.1, 2.8, 2.8])
  np.testing.assert_allclose(T.monotone([1.0, 3.0, 2.0, 1.0, 5.0]), [1.0, 2.0, 2.0, 2.0, 5.0])
  rng = np.random.default_rng(0)
  for _ in range(50):
    c = rng.uniform(0, 1, 6)
    m = np.asarray(T.monotone(list(c)))
    assert np.all(np.diff(m) >= -1e-12) and np.isclose(m.sum(), c.sum())


@contextlib.contextmanager
def _ks_run():
  """Collects the k of every step the decoder runs meanwhile (read off the drained rings)."""
  ks, orig = [], ring_lib.Drain.finish
  def spy(self):
    out = orig(self)
    ks.extend(np.asarray(out[2])[np.asarray(out[3]) > 0].tolist())
    return out
  ring_lib.Drain.finish = spy
  try:
    yield ks
  finally:
    ring_lib.Drain.finish = orig


class _Compiles(logging.Handler):
  def __init__(self):
    super().__init__()
    self.n = 0

  def emit(self, record):
    self.n += "Compiling" in record.getMessage()


@pytest.mark.slow
def test_k_changes_between_steps_without_recompiles_and_output_is_unchanged(trained_tiny):
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  prompts = [tok.encode(t) for t in ("def f(x):\n", "import os\n\nclass A:\n", "    return x",
                                     "for i in range(10):\n", "x = {'a': 1}\n")]
  reqs = [api.Request(p, n) for p, n in zip(prompts, [30, 12, 40, 25, 33])]
  plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=0)).run(reqs)
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, adaptive=True, ring_size=8,
                                                          adapt_margin=0.0))
  # Each draft costs 1% more: with the tiny heads' low confidences (~0.02) the controller starts
  # at k=1 (no margin asked over plain decoding), then raises k as the ring shows drafts being
  # accepted.
  dec.engine.cost = [1.0, 1.01, 1.02, 1.03, 1.04]
  dec.warmup(16)
  counter = _Compiles()
  logging.getLogger("jax").addHandler(counter)
  try:
    # The first run after warm-up included: a batch job is one run.
    with _ks_run() as ks, jax.log_compiles(True):
      dec.run(reqs[:1])
      out = dec.run(reqs)
  finally:
    logging.getLogger("jax").removeHandler(counter)
  assert counter.n == 0
  assert [c.token_ids for c in out] == [c.token_ids for c in plain]
  assert len(set(ks)) >= 2, f"k never changed: {sorted(set(ks))}"


def test_with_no_request_waiting_the_controller_aims_at_the_last_row():
  """Two rows with the same remaining budget, one drafting well and one badly: for throughput,
  drafting pays on average; for the end of the job, the bad row decides (brute force)."""
  cost = jnp.asarray([1.0, 1.5, 1.9, 2.3])
  alpha = jnp.asarray([[0.95, 0.95, 0.95], [0.2, 0.2, 0.2]])
  active, remaining = jnp.array([True, True]), jnp.array([100, 100])
  assert _choose(cost, alpha) > 0
  assert int(A.choose_k_to_finish(cost, alpha, active, remaining)) == 0
  # The bad row is nearly done: the good one decides, and it drafts.
  assert int(A.choose_k_to_finish(cost, alpha, active, jnp.array([100, 3]))) == 3
  # Finished rows do not count.
  assert int(A.choose_k_to_finish(cost, alpha, jnp.array([True, False]), remaining)) == 3
  rng = np.random.default_rng(0)
  for _ in range(100):
    b, k_max = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    alpha = rng.uniform(0, 1, (b, k_max))
    act = rng.uniform(size=b) < 0.8
    rem = rng.integers(1, 50, b)
    cost = np.cumsum(rng.uniform(0.01, 1.0, k_max + 1))
    t = [max([0.0] + [rem[r] / (1 + sum(np.prod(alpha[r, :j + 1]) for j in range(k))) * cost[k]
                      for r in range(b) if act[r]]) for k in range(k_max + 1)]
    got = int(A.choose_k_to_finish(jnp.asarray(cost), jnp.asarray(alpha), jnp.asarray(act),
                                   jnp.asarray(rem)))
    assert np.isclose(t[got], min(t)), (t, got)


def test_row_rates_shrink_towards_the_shared_estimate():
  alpha = A.row_alpha(jnp.asarray([0.5, 0.5]), jnp.asarray([1000.0, 1000.0]),
                      jnp.full((2, 2), 0.5), jnp.array([2, 2]),
                      jnp.asarray([[16.0, 16.0], [0.0, 0.0]]), jnp.asarray([[16.0, 16.0],
                                                                           [16.0, 16.0]]))
  # Row 0 accepted all of its 16 trials, row 1 none: at the first position halfway from the
  # shared 0.5 each way; the second position's prior is scaled by that (x1.5, x0.5), and there
  # the row's own 16 trials outweigh it 16 to 4 (rows differ more at later positions).
  np.testing.assert_allclose(np.asarray(alpha), [[0.75, (16 + 4 * 0.75) / 20],
                                                 [0.25, 4 * 0.25 / 20]], atol=1e-6)


def test_a_rows_own_counts_are_not_counted_twice():
  """The shared estimate a row is weighed against pools the other rows only: at one slot it is
  the prior, and the row's 8 trials (4 hits) move the estimate once, by 8 / (8 + 16)."""
  assert A.ROW_PRIOR_TRIALS == 16 and A.ROW_PRIOR_TRIALS_LATER == 4
  hits, trials = jnp.asarray([[4.0, 2.0]]), jnp.asarray([[8.0, 4.0]])
  rate, n = A.other_rows_rates(hits, trials)
  assert np.asarray(n).sum() == 0
  prior = jnp.asarray([0.9, 0.9])
  alpha = A.row_alpha(rate, n, jnp.full((1, 2), 0.1), jnp.array([2]), hits, trials, prior)
  first = (4 + 16 * 0.9) / 24
  # The second position's prior, 0.9, scaled by first / 0.9 (the row against the shared estimate).
  np.testing.assert_allclose(np.asarray(alpha), [[first, (2 + 4 * first) / 8]], atol=1e-6)
  # Two rows: each one's shared estimate is the other's rate (blended with the prior by trials).
  hits, trials = jnp.asarray([[8.0], [0.0]]), jnp.asarray([[16.0], [16.0]])
  rate, n = A.other_rows_rates(hits, trials)
  np.testing.assert_allclose(np.asarray(rate), [[0.0], [0.5]])
  np.testing.assert_allclose(np.asarray(n), [[16.0], [16.0]])


@pytest.mark.slow
def test_probes_back_off_while_plain_decoding_wins_and_reset_once_drafting_pays(trained_tiny):
  """A probe ends a plain segment: its second-to-last step drafts one head, its last step
  verifies that draft (a step of one draft: real acceptance for the window, even where the
  controller began plain) and drafts one head again. While probes lead to no drafting the gap
  between them doubles (up to probe_every_max; the count carries across generate calls, here
  of one step each), a probe that finds nothing does not end its call, and a drafting segment
  sets the gap to the acceptance window (in segments)."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=1, adaptive=True, ring_size=16, adapt_every=3,
                                          probe_every=2, probe_every_max=4, accept_window=6),
                 tok.eod_id)
  state = eng.init_state()
  pre = eng.prefill(params, [tok.encode("def f(x):\n")], jnp.stack([jax.random.key(0)]), [0.0],
                    [0], [1.0])
  state = eng.insert(pre, state, [0], [100], [0.0], [0], [1.0])
  state = _controller(state, cost=jnp.asarray([1.0] + [100.0] * eng.kd))   # drafting never pays
  drafting, verifying = [], []
  for step in range(42):
    state = eng.generate(params, state, 1)
    if int(state.drafts.n_fresh[0]) > 0:
      drafting.append(step)
    if int(state.record.ring.k_used[step % 16]) > 0:
      assert int(state.record.ring.verified[step % 16, 0]) == 1
      verifying.append(step)
  # Segments of 3 steps; probes after 2, then 4, then 4 (the cap) plain segments, each
  # drafting at its last two steps and verifying at the last.
  assert verifying == [5, 17, 29, 41], verifying
  assert drafting == [s + d for s in verifying for d in (-1, 0)], drafting
  assert int(state.controller.probe_gap) == 4
  # A call through the next probe (steps 51-53): plain up to it, the probe segment, then plain
  # decoding again in the same call, to the call's 15 steps.
  state = eng.generate(params, state, 15)
  assert int(state.record.step) == 57 and int(state.drafts.n_fresh[0]) == 0
  assert int(state.controller.plain_segs) == 1
  k_used = np.asarray(state.record.ring.k_used)
  assert k_used[np.arange(42, 57) % 16].tolist() == [0] * 11 + [1] + [0] * 3
  # Drafting made to pay even at the tiny heads' low acceptance: the next segment drafts, and
  # the gap is the acceptance window's 6 steps (2 segments): probes before that would see the
  # same rates.
  state = _controller(state, cost=jnp.asarray([1.0] + [0.9] * eng.kd))
  state = eng.generate(params, state, 6)
  assert int(np.asarray(state.record.ring.k_used)[np.arange(57, 63) % 16].max()) > 0
  assert int(state.controller.probe_gap) == 2


@pytest.mark.slow
def test_segments_of_all_heads_run_in_the_calls_top_level_loop(trained_tiny):
  """Drafting segments run in the call's top-level loops: where the probe loop would begin
  one, the call ends at that segment boundary and the next call runs it there."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=1, adaptive=True, ring_size=16, adapt_every=2,
                                          probe_every=2, adapt_margin=0.0), tok.eod_id)
  kd = eng.kd
  state = eng.init_state()
  pre = eng.prefill(params, [tok.encode("def f(x):\n")], jnp.stack([jax.random.key(0)]), [0.0],
                    [0], [1.0])
  state = eng.insert(pre, state, [0], [100], [0.0], [0], [1.0])
  # Two forced plain segments: no drafts made, and the next plain segment is a probe.
  state = eng.generate(params, _controller(state, k_force=jnp.asarray(0, jnp.int32)), 4)
  assert int(state.drafts.n_fresh[0]) == 0
  # Equal costs: the controller stays plain without fresh drafts, and drafts all heads once the
  # probe (a step drafting one head, then one verifying it and drafting one again) brings a
  # fresh draft (the later positions' rates come from the prior). The call ends after the
  # probe segment (2 of its 16 steps).
  state = eng.generate(params, _controller(state, k_force=jnp.asarray(-1, jnp.int32)), 16)
  assert int(state.record.step) == 6 and int(state.drafts.n_fresh[0]) == 1
  assert np.asarray(state.record.ring.k_used)[4:6].tolist() == [0, 1]
  state = eng.generate(params, state, 4)
  assert int(state.record.step) == 10
  assert np.asarray(state.record.ring.k_used)[6:10].tolist() == [kd] * 4


@pytest.mark.slow
def test_adaptive_loop_writes_the_kv_cache_in_place(trained_tiny):
  """Choosing k costs no copy of the KV cache: every step variant of the adaptive loop updates
  it in place, as a fixed-k engine's step does (the compiled loop holds no copy of a cache
  layer; a lax.switch over the variants would copy every layer on each call)."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  for adaptive in (False, True):
    eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=4, max_len=48, adaptive=adaptive),
                   tok.eod_id)
    state = eng.init_state()
    b, s, g, h = state.caches.trunk.k[0].shape
    for sample in (False, True):
      hlo = eng._generate.lower(params, state, jnp.asarray(8, jnp.int32),
                                jnp.asarray(0, jnp.int32), sample=sample,
                                ks=eng.ks).compile().as_text()
      copies = re.findall(rf"= f32\[{b},{s},{g},{h}\]\S* copy\(", hlo)
      assert hlo.count("while(") >= (2 * eng.kd + 2 if adaptive else 1)
      assert not copies, (adaptive, sample, copies[:3])


@pytest.mark.slow
def test_only_the_variants_that_can_pay_are_compiled(trained_tiny):
  """A k whose best case (every draft accepted) does not beat plain decoding under the cost
  table gets no loop; with none left the adaptive engine compiles plain decoding's loop. The
  output stays that of plain greedy decoding either way."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  prompts = [tok.encode(t) for t in ("def f(x):\n", "import os\n\nclass A:\n", "    return x")]
  reqs = [api.Request(p, n) for p, n in zip(prompts, [30, 12, 40])]
  plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=0))
  want = [c.token_ids for c in plain.run(reqs)]

  def loops(eng):
    hlo = eng._generate.lower(params, eng.init_state(), jnp.asarray(8, jnp.int32),
                              jnp.asarray(0, jnp.int32), sample=False,
                              ks=eng.ks).compile().as_text()
    return hlo.count("while(")

  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, adaptive=True, ring_size=8,
                                                          adapt_margin=0.0))
  kd = dec.engine.kd
  dec.engine.cost = [1.0, 1.01, 5.0] + [1.02 + 0.01 * i for i in range(kd - 2)]
  assert dec.engine.ks == (0, 1) + tuple(range(3, kd + 1))
  with _ks_run() as ran:
    out = dec.run(reqs)
  assert [c.token_ids for c in out] == want
  assert 2 not in ran and len(set(ran)) >= 2, sorted(set(ran))
  full = loops(dec.engine)
  dec.engine.cost = [1.0] + [2.0 + i for i in range(kd)]     # compute bound: no k pays
  assert dec.engine.ks == (0,)
  assert [c.token_ids for c in dec.run(reqs)] == want
  assert dec.last_stats["drafted"] == [0] * kd
  assert loops(dec.engine) == loops(plain.engine) < full


def test_rates_of_a_run_become_the_next_runs_prior():
  # 100 first drafts verified, 80 accepted; 80 second drafts reached, 60 accepted (conditional
  # 0.75); 60 third drafts reached, 30 accepted (0.5); a position with too few trials is unknown.
  assert T.run_rates([100, 80, 60], [80, 60, 30]) == [0.8, 0.75, 0.5]
  assert T.run_rates([100, 10], [80, 5]) == [0.8, -1.0]
  conf = jnp.full((2, 3), 0.3)
  no_trials = jnp.zeros((3,))
  alpha = A.row_alpha(jnp.zeros((3,)), no_trials, conf, jnp.array([3, 3]),
                      prior_K=jnp.asarray([0.9, 0.8, -1.0]))
  # Known positions take the prior, an unknown one the estimate before it.
  np.testing.assert_allclose(np.asarray(alpha), [[0.9, 0.8, 0.8]] * 2, atol=1e-6)
  # A head surer than the first position's prior keeps its confidence there.
  alpha = A.row_alpha(jnp.zeros((3,)), no_trials, jnp.asarray([[0.95, 0.3, 0.3], [0.3] * 3]),
                      jnp.array([3, 3]), prior_K=jnp.asarray([0.9, 0.8, -1.0]))
  np.testing.assert_allclose(np.asarray(alpha), [[0.95, 0.8, 0.8], [0.9, 0.8, 0.8]], atol=1e-6)
  alpha = A.row_alpha(jnp.zeros((3,)), no_trials, conf, jnp.array([3, 3]))
  np.testing.assert_allclose(np.asarray(alpha), np.full((2, 3), 0.3), atol=1e-6)


def test_rows_own_counts_remember_past_the_window(trained_tiny):
  """Per row and draft position, the decayed counts of drafts reached and accepted since the
  row's insert (what the controller weighs a row's later positions by) follow the ring's record
  of every step past the row's warm-up, across calls longer than the window; an insert starts
  a row's counts afresh. The run's conditional counters (the next run's prior) are the same
  counts, summed over rows and not decayed. With a profile, each trial weighs g at the row's
  output position (the ring records that position), and the first position's counts go to that
  position's bucket."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  warmup = 3
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=2, max_len=96, adaptive=True, ring_size=8,
                                          accept_window=4, adapt_warmup=warmup), tok.eod_id)
  kd, b = eng.kd, 2
  prompts = [tok.encode("def f(x):\n    return x"), tok.encode("import os\n")]
  prefix = eng.prefill(params, prompts, jax.random.key(0), [0.0] * b, [0] * b, [1.0] * b)
  state = eng.insert(prefix, eng.init_state(), [0, 1], 60, 0.0, 0, 1.0)
  profile = np.linspace(0.5, 1.5, A.PROFILE_BUCKETS).astype(np.float32)
  state = eng.put(state, profile=profile)
  hits, trials = np.zeros((b, kd)), np.zeros((b, kd))
  run_hits, run_trials, run_weight = np.zeros(kd), np.zeros(kd), np.zeros(kd)
  pos_hits, pos_trials = np.zeros(A.PROFILE_BUCKETS), np.zeros(A.PROFILE_BUCKETS)
  decay = 1.0 - 1.0 / A.ROW_MEMORY_STEPS
  pos = np.arange(kd)
  age = np.zeros(b, int)                    # each row's steps since its insert
  out = np.ones(b, int)                     # each row's output tokens (the prefill's first)
  for k in (kd, 1, kd, kd):
    s0 = int(state.record.step)
    state = eng.generate(params, _controller(state, k_force=jnp.asarray(k, jnp.int32)), 8,
                         sample=False)
    ring = state.record.ring
    for s in range(s0, int(state.record.step)):
      v, a = np.asarray(ring.verified[s % 8]), np.asarray(ring.accepted[s % 8])
      np.testing.assert_array_equal(np.asarray(ring.row_step[s % 8]), age)
      np.testing.assert_array_equal(np.asarray(ring.row_pos[s % 8]), out)
      reached = (pos[None] < v[:, None]) & (a[:, None] >= pos[None]) & (age >= warmup)[:, None]
      hit = reached & (a[:, None] > pos[None])
      bucket = np.minimum(out // A.PROFILE_TOKENS, A.PROFILE_BUCKETS - 1)
      g = profile[bucket][:, None]
      age = age + (np.asarray(ring.emitted[s % 8]) > 0)
      out = out + np.asarray(ring.emitted[s % 8])
      hits = hits * decay + hit
      trials = trials * decay + reached * g
      run_hits += hit.sum(0)
      run_trials += reached.sum(0)
      run_weight += (reached * g).sum(0)
      np.add.at(pos_trials, bucket, reached[:, 0])
      np.add.at(pos_hits, bucket, hit[:, 0])
  assert trials[:, 1:].sum() > 0 and hits[:, 1:].sum() > 0
  assert np.count_nonzero(pos_trials) >= 3          # the rows' trials span several buckets
  np.testing.assert_allclose(np.asarray(state.controller.row_trials), trials, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(state.controller.row_hits), hits, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(state.record.cond_trials), run_trials)
  np.testing.assert_array_equal(np.asarray(state.record.cond_hits), run_hits)
  np.testing.assert_allclose(np.asarray(state.controller.cond_weight), run_weight, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(state.controller.pos_trials), pos_trials)
  np.testing.assert_array_equal(np.asarray(state.controller.pos_hits), pos_hits)
  # k changed between calls, so a later position was verified in fewer steps than the one
  # before it was reached: its conditional rate is not accepted / drafted there.
  st = E.stats(state)
  assert st["drafted"][1] < st["cond_trials"][0]
  assert T.run_rates(run_trials, run_hits, min_trials=1) == pytest.approx(run_hits / run_trials)
  state = eng.insert(eng.prefill(params, prompts[:1], jax.random.key(1), [0.0], [0], [1.0]),
                     state, [1], 60, 0.0, 0, 1.0)
  np.testing.assert_allclose(np.asarray(state.controller.row_trials)[1], 0.0)
  np.testing.assert_allclose(np.asarray(state.controller.row_trials)[0], trials[0], rtol=1e-5)


@pytest.mark.slow
def test_cost_table_is_measured_to_the_asked_precision(trained_tiny):
  """Rounds of every k go on until each cost ratio's standard error is below rel_err, or the
  time budget is spent (after min_rounds); the table is non-decreasing in k."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=2, max_len=64, adaptive=True, ring_size=8),
                 tok.eod_id)
  cost, info = T.measure_costs(eng, params, rel_err=10.0, min_rounds=3)     # met at once
  assert info["rounds"] == 3 and len(cost) == eng.kd + 1
  assert all(c > 0 for c in cost) and np.all(np.diff(cost) >= 0)
  cost, info = T.measure_costs(eng, params, rel_err=0.0, budget_s=0.0, min_rounds=4)
  assert info["rounds"] == 4 and info["rel_se"] > 0            # never met: the budget ends it
  cost, info = T.measure_costs(eng, params, rel_err=0.0, budget_s=1e9, min_rounds=2,
                               max_rounds=6)
  assert info["rounds"] == 6
  # An engine without drafts has no ratio to measure: min_rounds, then done.
  eng0 = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=2, max_len=64, adaptive=True, k=0,
                                           ring_size=8), tok.eod_id)
  cost, info = T.measure_costs(eng0, params, min_rounds=2)
  assert len(cost) == 1 and cost[0] > 0 and info == {"rounds": 2, "rel_se": 0.0}


@pytest.mark.slow
def test_a_later_process_starts_from_the_acceptance_a_run_stored(trained_tiny, tmp_path):
  """Beside the cost table, a run stores the acceptance per position it measured, keyed by the
  weights, greedy and sampled apart; a new decoder of the same model starts from the first
  position's rate (later positions are left to its own trials); other weights do not find it."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  dcfg = DecodeConfig(batch_size=2, max_len=96, adaptive=True, ring_size=8)
  path = str(tmp_path / "tables.json")
  reqs = [api.Request(tok.encode(p), 40) for p in ("def f(x):\n    return x", "import os\n")]

  def decoder(p=params):
    dec = api.Decoder(mcfg, hcfg, p, tok, dcfg)
    # Drafting all but free: the controller drafts, and the run has counts to store.
    T.save_table(path, T.table_key(dec.engine),
                 [1.0 + 0.01 * k for k in range(dec.engine.kd + 1)])
    dec.calibrate(path)
    starts = []
    generate = dec.engine.generate

    def spy(params_, state, *a, **kw):
      if not starts:
        ctrl = state.controller
        starts.extend([np.asarray(ctrl.prior_rate), np.asarray(ctrl.profile)])
      return generate(params_, state, *a, **kw)
    dec.engine.generate = spy
    return dec, starts

  dec, starts = decoder()
  dec.run(reqs)
  assert np.all(starts[0] == -1.0)                                        # nothing stored yet
  st = dec.last_stats
  assert st["cond_trials"][0] >= 16, st
  stored = T.load_rates(path, T.rates_key(dec.engine, T.params_fingerprint(params), False))
  assert stored is not None
  assert stored[0] >= 0
  assert stored == pytest.approx(T.run_rates(st["cond_weight"], st["cond_hits"]), abs=1e-4)
  # ... and its first-position counts per output-position bucket: the next process's profile.
  profile = T.load_profile(path, T.rates_key(dec.engine, T.params_fingerprint(params), False))
  np.testing.assert_allclose(profile, [st["pos_trials"], st["pos_hits"]])
  assert np.all(starts[1] == 1.0)                                         # flat
  assert T.load_rates(path, T.rates_key(dec.engine, T.params_fingerprint(params), True)) is None

  dec2, starts2 = decoder()
  dec2.run(reqs)
  np.testing.assert_allclose(starts2[0], [stored[0]] + [-1.0] * (dec2.engine.kd - 1),
                             atol=1e-6)
  np.testing.assert_allclose(starts2[1], T.run_profile(*profile), rtol=1e-6)

  other = jax.tree.map(lambda x: x * 1.01 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                       params)
  assert T.params_fingerprint(other) != T.params_fingerprint(params)
  dec3, starts3 = decoder(other)
  dec3.run(reqs)
  assert np.all(starts3[0] == -1.0)
