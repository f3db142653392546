"""Adaptive prediction length: the number of drafts k for the next steps, chosen on the device.

Speculation pays while a step is memory bound (verifying k+1 tokens costs about as much as one)
and stops paying when the batch makes it compute bound. Once per segment of adapt_every steps the
controller picks

  k* = argmax_k  sum over active rows of E[emitted | k]  /  c(k),      k in 0..K_max,

where c(k) is the time of one step with k drafts at the engine's slot count, as the host learns
it from the run's calls (costs.py, one standard error optimistic) and E[emitted | k] = 1 + sum_{j<=k} prod_{i<=j} alpha_i. alpha_i is the
conditional acceptance at draft position i (accepted, given that every draft before it was):
the counts of the ring's last accept_window steps, pooled over the rows, blended with a prior by
their number of trials against the prior's pseudo-trials (Controller.prior_trials). Pooled
conditional rates give the batch's expected tokens per step as it is, whatever the spread between
rows: the share of row-steps whose first j drafts are accepted is the product of the conditional
rates. The prior is the rate earlier runs of the same weights measured, counting for as many
trials as their requests' scatter says the text at hand is like them (priors.py), else a guess
counting for one window: the head's confidence in the row's draft, and for a position never tried
the estimate of the position before it.

Two guards keep the promise of never being slower than plain decoding where drafting does not
clearly pay: each alpha is taken one standard error below its estimate (the window's error as it
enters the blend, lower_blend: a k chosen because its estimate looked high would otherwise be
chosen mostly where the estimate erred upwards, and the next steps then realise less), and k > 0
must beat plain decoding by adapt_margin (the cost table's own error). A plain segment drafts
nothing, so probes (loop.py) check one draft against plain decoding's token now and then to keep
the window's counts current; a probe is made only where some k would beat plain decoding at each
rate one standard error *above* its estimate (worth_probing): where even that cannot pay, a probe
costs the heads' work and changes nothing.

With trees among the candidates (shape_set.py) the same rule picks a shape: k indexes chains
0..Kd, then trees, each with its cost table entry and its E[emitted] from the same rates.

Once no request will take a slot (`Engine.generate(closed=True)`), the job ends with its
slowest row: the controller then minimises the expected end of the last row (choose_k_to_finish),
each row's rate from its own counts since its insertion (Rows.cond_hits / cond_trials), shrunk
towards the pooled estimate by as much as the rows' scatter says they are alike
(row_prior_trials), and taken below its estimate by the spread of what the slowest of the rows
will realise (finish_alpha).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.decoding import ring as ring_lib
from mtp_jax.decoding.shape_set import ShapeSet, row_expected


@struct.dataclass
class Controller:
  """The controller's state in the decode state (adaptive engines only): the cost table, the
  host's settings, the segment bookkeeping and the prior from earlier runs. The acceptance
  counts it reads are the ring's (DecodeState.record)."""
  cost: jax.Array          # [Kd+1] seconds per step with k drafts
  k_force: jax.Array       # [] -1: the controller chooses k; else this k (tests, benches)
  probe_gap: jax.Array     # [] plain segments between probes (probe_every at the start,
                           # doubling while probes find nothing worth drafting; accept_window
                           # steps after k > 0)
  plain_segs: jax.Array    # [] plain segments ended since the last probe or drafting segment
  seg_k: jax.Array         # [] k of the current segment (a call that begins inside a segment
                           # continues it)
  prior_rate: jax.Array    # [Kd] conditional acceptance per draft position from earlier runs
                           # (-1: unknown)
  prior_trials: jax.Array  # [Kd] the pseudo-trials the prior counts for in a blend with the
                           # window (priors.py; a guess where the rate is unknown: one window)
  wanted: jax.Array        # [S] int32: per shape, the segments it would have run, were every
                           # shape compiled (the host compiles those it lacks: Engine.open)


def init_controller(kd: int, cost, probe_every: int, window: int, prior=None,
                    prior_trials=None) -> Controller:
  """prior [Kd]: the conditional acceptance per position earlier runs measured (default
  unknown, -1); prior_trials [Kd]: what it counts for (default, and where the rate is unknown:
  one window, `window` trials)."""
  prior = jnp.full((kd,), -1.0, jnp.float32) if prior is None else jnp.asarray(prior, jnp.float32)
  m = jnp.full((kd,), window, jnp.float32) if prior_trials is None else prior_trials
  m = jnp.where(prior >= 0, jnp.asarray(m, jnp.float32), float(window))
  cost = jnp.asarray(cost, jnp.float32)
  return Controller(
      cost=cost, k_force=jnp.asarray(-1, jnp.int32),
      probe_gap=jnp.asarray(probe_every, jnp.int32), plain_segs=jnp.zeros((), jnp.int32),
      seg_k=jnp.zeros((), jnp.int32), prior_rate=prior, prior_trials=m,
      wanted=jnp.zeros(cost.shape, jnp.int32))


def choose(state, limit_B, allowed_S, window: int, margin: float, ss: ShapeSet | None = None,
           closed=False, room_S=None):
  """The controller's shape for the next segment (an index of ss: k <= Kd a chain of k drafts,
  past it a tree), on the device, from the decode state (its ring, rows, drafts' confidences and
  the controller's own state); a forced index (k_force) becomes the largest allowed one not
  above it. limit_B: per row, the drafts it may be expected to verify (none without a fresh
  draft). closed: no request will take a slot (the end of the job counts). -> (the shape among
  allowed_S, the shape among room_S (default allowed_S): what would run were every shape
  compiled)."""
  c, rows = state.controller, state.rows
  kd = state.drafts.conf.shape[1]
  ss = ShapeSet(kd) if ss is None else ss
  rate_K, trials_K = window_rates(state.record.ring, state.record.step, window, kd)
  m_K = prior_weight(c, ~rows.done)
  pooled_BK = blend(rate_K, trials_K, state.drafts.conf, c.prior_rate, m_K)
  cut = jnp.arange(kd)[None] < limit_B[:, None]
  alpha_BK = jnp.where(cut, lower_blend(pooled_BK, trials_K, m_K), 0.0)
  # Once none waits, the job ends with its slowest row: each row's own counts since its
  # insertion (the pooled estimate their prior) and the spread of what it will realise
  # (finish_alpha). A window would forget which rows draft badly in a plain stretch.
  hits_BK = rows.cond_hits.astype(jnp.float32)
  trials_BK = rows.cond_trials.astype(jnp.float32)
  m_K = row_prior_trials(hits_BK, trials_BK, ~rows.done, trials_K + m_K)
  own_BK = (hits_BK + m_K * pooled_BK) / (trials_BK + m_K)
  own_BK = finish_alpha(own_BK, trials_BK + m_K, rows.remaining, ~rows.done)
  own_BK = jnp.where(cut, own_BK, 0.0)
  active = ~rows.done
  expected_S = jnp.sum(jnp.where(active[:, None], ss.expected(alpha_BK, cut), 0.0), 0)
  own_S = ss.expected(own_BK, cut)

  def pick(ok_S):
    return jnp.where(closed, choose_k_to_finish(c.cost, own_BK, active, rows.remaining, margin,
                                                ok_S, own_S),
                     choose_k(c.cost, expected_S, margin, ok_S))
  k = pick(allowed_S)
  want = k if room_S is None else pick(room_S)
  index = jnp.arange(ss.size)
  forced = jnp.max(jnp.where(allowed_S & (index <= c.k_force), index, 0))
  k = jnp.where(c.k_force >= 0, forced, k).astype(jnp.int32)
  return k, jnp.where(c.k_force >= 0, k, want).astype(jnp.int32)


def prior_weight(c: Controller, active_B):
  """-> [K]: the pseudo-trials the prior counts for against the window, which pools the active
  rows: their mean rate strays from the prior's as far as one request's does over their number
  (tau^2 / n), so a measured prior of m pseudo-trials per request counts for n (m + 1) - 1. A
  guess (unknown rate) counts for its own."""
  n = jnp.maximum(jnp.sum(active_B.astype(jnp.float32)), 1.0)
  return jnp.where(c.prior_rate >= 0, n * (c.prior_trials + 1.0) - 1.0, c.prior_trials)


def row_prior_trials(hits_BK, trials_BK, active_B, most_K):
  """-> [K]: the pseudo-trials the pooled rate counts for in a row's own estimate, from how far
  the rows' window rates scatter (empirical Bayes, beta-binomial moments): true rates spread
  around the pooled p with variance tau^2 = p (1 - p) / (m + 1), and tau^2 is the rows' observed
  scatter less their binomial noise. Rows alike (no scatter beyond the noise): the pool's own
  trials (plus the prior's), as sure as the pool; rows far apart: few, so that a row that drafts
  badly shows in its estimate within a few steps (at 4 slots, one row accepting 0.55 of its
  first drafts among three at 0.95 set the job's end). most_K: the pool's weight (the window's
  trials and the prior's)."""
  on_BK = active_B[:, None] & (trials_BK > 0)
  rows_K = jnp.maximum(jnp.sum(on_BK, 0), 1)
  n_K = jnp.sum(jnp.where(on_BK, trials_BK, 0.0), 0)
  p_K = jnp.sum(jnp.where(on_BK, hits_BK, 0.0), 0) / jnp.maximum(n_K, 1.0)
  r_BK = hits_BK / jnp.maximum(trials_BK, 1.0)
  pq_K = p_K * (1.0 - p_K)
  scatter_K = jnp.sum(jnp.where(on_BK, (r_BK - p_K) ** 2, 0.0), 0) / rows_K
  noise_K = jnp.sum(jnp.where(on_BK, pq_K / jnp.maximum(trials_BK, 1.0), 0.0), 0) / rows_K
  tau2_K = scatter_K - noise_K
  m_K = jnp.where(tau2_K > 0, pq_K / jnp.maximum(tau2_K, 1e-12) - 1.0, most_K)
  return jnp.clip(m_K, 1.0, jnp.maximum(most_K, 1.0))


def blend(rate_K, trials_K, conf_BK, prior_K, m_K):
  """-> [B, K]: per row and draft position, the window's rate blended with the prior by trials
  (the prior counting for m_K pseudo-trials). The prior: prior_K where known (>= 0), else the
  row's head confidence at the first position and the estimate of the position before at later
  ones. A known prior outweighs any confidence (why: docs/adaptive.md, Open questions)."""
  lam_K = trials_K / (trials_K + m_K)
  cols, prev = [], conf_BK[:, 0]
  for i in range(conf_BK.shape[1]):
    prior = jnp.where(prior_K[i] >= 0, prior_K[i], prev)
    prev = jnp.clip(lam_K[i] * rate_K[i] + (1.0 - lam_K[i]) * prior, 0.0, 1.0)
    cols.append(prev)
  return jnp.stack(cols, 1)


def worth_probing(state, allowed_S, window: int, margin: float, ss: ShapeSet | None = None):
  """-> [] bool: whether a probe could lead to drafting: some allowed k > 0 beats plain decoding
  by the margin at each rate one standard error above its estimate (optimistic_pays, on the
  window's pooled counts). Probing where even this optimistic rate cannot pay costs the heads'
  work and changes nothing (at 16 slots on XLA:CPU a step of one draft costs ~1.8 plain steps:
  a draft must be accepted over 80% of the time to pay)."""
  c = state.controller
  kd = c.prior_rate.shape[0]
  rate_K, trials_K = window_rates(state.record.ring, state.record.step, window, kd)
  return optimistic_pays(c, rate_K, trials_K, prior_weight(c, ~state.rows.done), allowed_S,
                         margin, ss)


def optimistic_pays(c: Controller, rate_K, trials_K, m_K, allowed_S, margin: float,
                    ss: ShapeSet | None = None):
  """-> [] bool: some allowed k > 0 beats plain decoding by the margin at each rate one
  standard error above its estimate: the window's rate over trials_K blended with the prior
  counting for m_K pseudo-trials (an unknown prior is 1 at the first position, the position
  before's estimate past it)."""
  kd = c.prior_rate.shape[0]
  ss = ShapeSet(kd) if ss is None else ss
  n_K = trials_K + m_K
  cols, prev = [], jnp.asarray(1.0)
  for i in range(kd):
    prior = jnp.where(c.prior_rate[i] >= 0, c.prior_rate[i], prev)
    prev = (trials_K[i] * rate_K[i] + m_K[i] * prior) / n_K[i]
    cols.append(jnp.clip(prev + jnp.sqrt(prev * (1.0 - prev) / n_K[i]), 0.0, 1.0))
  return choose_k(c.cost, ss.expected(jnp.stack(cols)), margin, allowed_S) > 0


def lower_blend(alpha_BK, trials_K, m_K):
  """One standard error below a blend (blend) of the window's rate over trials_K with a prior
  of m_K pseudo-trials: the window's weight times the window's binomial error,
  lam sqrt(a (1 - a) / n) = sqrt(a (1 - a) n) / (n + m). The guard is against the window's
  sampling error (a k chosen on counts that look high); a prior is no sample picked for looking
  high: earlier runs' rate, measured over far more trials than the window holds, or a guess (a
  head's confidence, the position before's estimate). With no trial in the window: the prior."""
  se_BK = jnp.sqrt(alpha_BK * (1.0 - alpha_BK) * trials_K) / (trials_K + m_K)
  return jnp.clip(alpha_BK - se_BK, 0.0, 1.0)


def estimate(rate_K, trials_K, conf_BK, prior_K, m_K):
  """-> [B, K]: the acceptance the controller counts on while requests wait: blend, less one
  standard error (lower_blend)."""
  return lower_blend(blend(rate_K, trials_K, conf_BK, prior_K, m_K), trials_K, m_K)


def row_window(ring: ring_lib.Ring, step, window: int, k_max: int):
  """Per row and draft position i, over the last `window` steps: how often the row reached
  position i (verified there with every draft before it accepted: trials) and how often it was
  accepted there (hits). -> (hits, trials) [B, K] f32."""
  r = ring.capacity
  age = (step - 1 - jnp.arange(r)) % r              # 0 = the newest record
  valid = (age < jnp.minimum(window, step))[:, None, None]                 # [R, 1, 1]
  pos = jnp.arange(k_max)[None, None]                                      # [1, 1, K]
  verified, accepted = ring.verified[..., None], ring.accepted[..., None]  # [R, B, 1]
  trials = valid & (verified > pos) & (accepted >= pos)
  hits = trials & (accepted > pos)
  return jnp.sum(hits, 0).astype(jnp.float32), jnp.sum(trials, 0).astype(jnp.float32)


def window_rates(ring: ring_lib.Ring, step, window: int, k_max: int):
  """Per draft position i: the conditional acceptance rate P(accept i | reached i) over the last
  `window` steps, pooled over rows, and the number of trials. -> (rate [K], trials [K])."""
  hits_BK, trials_BK = row_window(ring, step, window, k_max)
  n_trials = jnp.sum(trials_BK, 0)
  return jnp.sum(hits_BK, 0) / jnp.maximum(n_trials, 1.0), n_trials


def expected_emitted(alpha_BK, active_B):
  """-> [K+1]: sum over active rows of E[emitted tokens | k drafts], k = 0..K."""
  return jnp.sum(jnp.where(active_B[:, None], row_expected(alpha_BK), 0.0), axis=0)


def choose_k(cost_K1, expected_K1, margin: float = 0.0, allowed_K1=None):
  """argmax_k expected[k] / cost[k]; ties go to the smaller k. With a margin, drafting is chosen
  only when it is expected to beat plain decoding by more than that fraction (the cost table
  carries an error). allowed_K1 (bool): the k that may be chosen (default all)."""
  rate = expected_K1 / cost_K1
  if allowed_K1 is not None:
    rate = jnp.where(allowed_K1, rate, -jnp.inf)
  best = jnp.argmax(rate)
  return jnp.where(rate[best] > rate[0] * (1.0 + margin), best, 0).astype(jnp.int32)


def finish_alpha(alpha_BK, n_BK, remaining_B, active_B):
  """-> [B, K]: the acceptance to plan the end of a job with. A row realises over its h
  remaining steps a rate around its estimate with variance a(1 - a) (1/n + 1/h) (the estimate's
  error over its n trials and the binomial scatter of h steps), and the job ends with the slowest
  of the m active rows: each rate is taken the expected maximum of m standard normals (Blom's
  approximation, 0 for one row) standard deviations below its estimate."""
  m = jnp.sum(active_B.astype(jnp.float32))
  z = jax.scipy.special.ndtri((m - 0.375) / (m + 0.25))
  h_B = jnp.maximum(jnp.asarray(remaining_B, jnp.float32) / (1.0 + alpha_BK[:, 0]), 1.0)
  sd_BK = jnp.sqrt(alpha_BK * (1.0 - alpha_BK) * (1.0 / n_BK + 1.0 / h_B[:, None]))
  return jnp.clip(alpha_BK - jnp.maximum(z, 0.0) * sd_BK, 0.0, 1.0)


def choose_k_to_finish(cost_K1, alpha_BK, active_B, remaining_B, margin: float = 0.0,
                       allowed_K1=None, expected_BK1=None):
  """When no request waits, only the end of the job counts: the k that minimises max over
  active rows of remaining_i / E_i[emitted | k] x c(k) (a row that finishes early frees a slot
  nobody takes, while every step costs c(k) for all slots). Ties go to the smaller k; k > 0
  only when expected to finish sooner than plain decoding by more than `margin`.
  expected_BK1: E_i[emitted] per shape (ShapeSet.expected; default the chains' at alpha)."""
  rem = jnp.asarray(remaining_B, jnp.float32)[:, None]
  e = row_expected(alpha_BK) if expected_BK1 is None else expected_BK1
  t = jnp.where(active_B[:, None], rem / e * cost_K1[None], 0.0)
  t = jnp.max(t, axis=0)
  if allowed_K1 is not None:
    t = jnp.where(allowed_K1, t, jnp.inf)
  best = jnp.argmin(t)
  return jnp.where(t[best] * (1.0 + margin) < t[0], best, 0).astype(jnp.int32)
