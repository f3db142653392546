"""Adaptive prediction length: choose the number of drafts k for the next step, on the device.

Speculation pays while a step is memory bound (verifying k+1 tokens costs about as much as one)
and stops paying when the batch makes it compute bound. The controller picks

  k* = argmax_k  sum over active rows of E[emitted | k]  /  c(k),      k in 0..K_max,

where c(k) is the measured time of one step with k drafts at the engine's slot count (the cost
table) and E[emitted | k] = 1 + sum_{j<=k} prod_{i<=j} alpha_{row,i}. The per-row acceptance
estimate alpha blends the windowed per-position conditional acceptance rate read from the ring
with the head's own confidence in this step's first draft and the row's own window rate (see
row_alpha); with a confidence threshold a row's chain is cut at its first doubtful draft. k = 0 is
plain decoding, and k > 0 is chosen only when its expected gain over plain decoding exceeds a
margin (decode.adapt_margin): the promise is never to be slower than plain decoding, and the
cost table and the estimates carry errors.

Once no request waits for a slot (the host says so: DecodeState.closed), tokens per second of the
whole batch no longer matter, only when its last row finishes: the controller then minimises the
expected max over active rows of remaining_i / E_i[emitted | k] * c(k) (choose_k_to_finish).
Otherwise rows that draft well would finish early and leave their slots idle while the rows that
draft badly, at the same cost per step, set the end of the job. The expectation runs over the
acceptance each row will realise (FINISH_DRAWS fixed draws around its estimate, spread by the
trials behind it and by the steps it has left: finish_sd), since the max over rows is set by the
rows that may draft worse than they seem. There a row's own counts are its whole memory
(DecodeState.row_hits / row_trials) at every position: a row that lags lags because it drafted
worse, also where that was longer ago than the window.
"""

from __future__ import annotations

from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtp_jax import ring as ring_lib

PRIOR_TRIALS = 16.0   # trials after which the windowed rate outweighs the confidences
# Trials after which a row's own rate outweighs the shared estimate, at the first draft position
# and at later ones: p(1 - p) / (the spread of the rows' true rates)^2. Rows differ more at later
# positions (some text lets the third draft through, some never): on the demo model, whole runs at
# 4, 16 and 64 slots show rows' first-position rates spread by 0.12-0.17 around ~0.78 and later
# positions' by 0.19-0.41 around ~0.7.
ROW_PRIOR_TRIALS = 16.0
ROW_PRIOR_TRIALS_LATER = 4.0
# A row's own acceptance counts (DecodeState.row_hits / row_trials) decay by 1 - 1/this per step:
# they remember its positions past the first over the few drafting segments the controller tries
# there, and still follow a change of text.
ROW_MEMORY_STEPS = 64.0
# A row's acceptance is overdispersed: accepted drafts come in runs (a repetitive stretch of code,
# then a novel one), so n drafts tell about as much as n / ROW_OVERDISPERSION independent trials
# would. With ROW_PRIOR_TRIALS = 16 this puts the spread of rows' rates with no counts of their own
# at sqrt(2 x 0.78 x 0.22 / 16) = 0.15, the spread of whole requests' rates on the demo model
# (0.16-0.17 at 16 and 256 slots; 0.10 when the counts were taken as binomial).
ROW_OVERDISPERSION = 2.0
FINISH_DRAWS = 64     # draws of the rows' acceptance over which choose_k_to_finish takes its mean
# Acceptance by output position (the profile): a request's drafts are accepted less often near the
# start of its output than later, where text repeats what came before. On the demo model, over
# whole runs at 16, 64 and 256 slots, the first draft is accepted 54-60% of the time in a row's
# first 16 tokens, 68-75% in tokens 16-31 and 77-85% past token 48; rates measured early in a
# request then understate the rest of it (a closed batch of 16 read 0.58 in its first drafting
# steps and decoded the rest plainly, 127 steps, where drafting throughout took 84). Earlier runs'
# first-position counts per bucket of PROFILE_TOKENS output tokens (the last bucket open-ended)
# give g(bucket), each bucket's rate over the runs' whole rate; every count the controller reads is
# weighed by g where it was made (a level: the rate at g = 1), and its estimate for the steps ahead
# is that level times g there (see profile_weight, future_gain).
PROFILE_TOKENS = 16
PROFILE_BUCKETS = 8
PROFILE_PRIOR_TRIALS = 64.0   # a bucket's trials after which its own rate outweighs the whole rate
PROFILE_KEEP = 4096.0         # the stored counts are scaled to at most this many trials


@struct.dataclass
class Controller:
  """The controller's own state in the decode state (adaptive engines only): the cost table,
  the host's settings, the segment bookkeeping, the prior from earlier runs and the acceptance
  counts the steps feed it (observe)."""
  cost: jax.Array          # [Kd+1] seconds per step with k drafts
  k_force: jax.Array       # [] -1: the controller chooses k; else this k (calibration)
  closed: jax.Array        # [] bool: no request waits for a slot (the controller then aims at
                           # the end of the job rather than tokens per second)
  probe_gap: jax.Array     # [] plain segments between probes (probe_every at the start,
                           # doubling while probes find nothing worth drafting; accept_window
                           # steps after k > 0)
  plain_segs: jax.Array    # [] plain segments ended since the last probe or drafting segment
  seg_k: jax.Array         # [] k of the current segment (a call that begins inside a segment
                           # continues it)
  prior_rate: jax.Array    # [Kd] acceptance per draft position from earlier runs (-1: unknown;
                           # the controller's prior before the ring has counts), a level
  profile: jax.Array       # [N] f32: g per output-position bucket, from earlier runs (all ones:
                           # flat; see PROFILE_TOKENS)
  cond_weight: jax.Array   # [Kd] f32: the run's trials (Record.cond_trials), each weighed by
                           # the profile's g at the row's output position (cond_hits /
                           # cond_weight: the run's level)
  pos_trials: jax.Array    # [N] int32: first-position trials per output-position bucket
  pos_hits: jax.Array      # [N] int32: and hits there (run_profile)
  row_hits: jax.Array      # [B, Kd] f32: the row's drafts accepted per position, since its
                           # insert, decaying over ROW_MEMORY_STEPS steps
  row_trials: jax.Array    # [B, Kd] f32: the same for the drafts verified (reached) there


def init_controller(b: int, kd: int, cost, probe_every: int) -> Controller:
  return Controller(
      cost=jnp.asarray(cost, jnp.float32), k_force=jnp.asarray(-1, jnp.int32),
      closed=jnp.asarray(False), probe_gap=jnp.asarray(probe_every, jnp.int32),
      plain_segs=jnp.zeros((), jnp.int32), seg_k=jnp.zeros((), jnp.int32),
      prior_rate=jnp.full((kd,), -1.0, jnp.float32),
      profile=jnp.ones((PROFILE_BUCKETS,), jnp.float32),
      cond_weight=jnp.zeros((kd,), jnp.float32),
      pos_trials=jnp.zeros((PROFILE_BUCKETS,), jnp.int32),
      pos_hits=jnp.zeros((PROFILE_BUCKETS,), jnp.int32),
      row_hits=jnp.zeros((b, kd), jnp.float32), row_trials=jnp.zeros((b, kd), jnp.float32))


def reset_rows(ctrl: Controller, slots) -> Controller:
  """Newly inserted rows start with no memory of their own."""
  return ctrl.replace(row_hits=ctrl.row_hits.at[slots].set(0.0),
                      row_trials=ctrl.row_trials.at[slots].set(0.0))


def observe(ctrl: Controller, reached_BK, hit_BK, out_pos_B) -> Controller:
  """One step's acceptance into the controller's counts: reached_BK, which drafts were verified
  with every draft before them accepted (a row's warm-up steps left out), hit_BK, which of those
  were accepted, out_pos_B, each row's output tokens before the step. Trials weigh g at the
  row's output position (a level), the first position's counts go to its bucket (the next run's
  profile), and the same per row, decaying."""
  g = profile_weight(ctrl.profile, out_pos_B)[:, None]                       # [B, 1]
  pos_trials, pos_hits = ctrl.pos_trials, ctrl.pos_hits
  if reached_BK.shape[1]:
    bucket = profile_bucket(out_pos_B)
    pos_trials = pos_trials.at[bucket].add(reached_BK[:, 0].astype(jnp.int32))
    pos_hits = pos_hits.at[bucket].add(hit_BK[:, 0].astype(jnp.int32))
  decay = 1.0 - 1.0 / ROW_MEMORY_STEPS
  return ctrl.replace(
      cond_weight=ctrl.cond_weight + jnp.sum(reached_BK.astype(jnp.float32) * g, 0),
      pos_trials=pos_trials, pos_hits=pos_hits,
      row_hits=ctrl.row_hits * decay + hit_BK.astype(jnp.float32),
      row_trials=ctrl.row_trials * decay + reached_BK.astype(jnp.float32) * g)


def choose(state, limit_B, allowed_K1, window: int, warmup: int, margin: float):
  """The controller's k for the next step, on the device, from the decode state (its ring, rows,
  drafts' confidences and the controller's own state): argmax of expected tokens per second
  while requests wait, the expected end of the last row once none waits (closed); a forced k
  (k_force) becomes the largest allowed k not above it. limit_B: per row, the drafts it may be
  expected to verify (none without a fresh draft)."""
  c, rows = state.controller, state.rows
  kd = state.drafts.tokens.shape[1]
  # Every count is a level (weighed by the profile where it was made); the estimate for the
  # steps ahead is the level times g there: at the row's output position for the next step,
  # the mean over its tokens still to come once none waits (future_gain).
  hits_b, trials_b = row_window(state.record.ring, state.record.step, window, kd, warmup,
                                c.profile)
  rate, trials = other_rows_rates(hits_b, trials_b)
  # A row's own counts: the window's at the first position, which every drafting step tries;
  # past it, the longer memory (row_hits / row_trials), since those positions get trials only
  # while the controller drafts that far: forgetting them after accept_window steps sent it
  # back to drafting that far every few segments, at the cost of a wasted segment each time.
  # Once none waits, what counts is when the last rows finish, and a row lags because it
  # drafted worse, also longer ago than the window: the memory then serves the first position
  # too (with the window there, the controller took the rows that lagged at 256 slots for
  # average ones and drafted the last 30-40 steps of a job, at a loss).
  first_hits = jnp.where(c.closed, c.row_hits[:, :1], hits_b[:, :1])
  first_trials = jnp.where(c.closed, c.row_trials[:, :1], trials_b[:, :1])
  own_hits = jnp.concatenate([first_hits, c.row_hits[:, 1:]], 1)
  own_trials = jnp.concatenate([first_trials, c.row_trials[:, 1:]], 1)
  remaining, out_pos = rows.remaining, rows.out_pos
  g_now = profile_weight(c.profile, out_pos)
  gain = jnp.where(c.closed, future_gain(c.profile, out_pos, remaining), g_now)
  alpha = row_alpha(rate, trials, state.drafts.conf / g_now[:, None], limit_B, own_hits,
                    own_trials, c.prior_rate, gain)
  active = ~rows.done
  k = jnp.where(c.closed,
                choose_k_to_finish(c.cost, alpha, active, remaining, margin, allowed_K1,
                                   finish_sd(alpha, own_trials, remaining)),
                choose_k(c.cost, expected_emitted(alpha, active), margin, allowed_K1))
  forced = jnp.max(jnp.where(allowed_K1 & (jnp.arange(kd + 1) <= c.k_force),
                             jnp.arange(kd + 1), 0))
  return jnp.where(c.k_force >= 0, forced, k).astype(jnp.int32)


def profile_bucket(pos):
  """Output tokens before a step -> the profile's bucket (int32, same shape)."""
  return jnp.minimum(jnp.asarray(pos, jnp.int32) // PROFILE_TOKENS, PROFILE_BUCKETS - 1)


def profile_weight(profile_N, pos):
  """g at output positions `pos` (any shape): what a trial there counts for in a level."""
  return profile_N[profile_bucket(pos)]


def future_gain(profile_N, pos_B, remaining_B):
  """-> [B]: the mean of g over each row's tokens still to come, positions pos .. pos +
  remaining - 1 (g at pos where nothing remains): a row's level times this is the acceptance it
  is expected to realise until it finishes (choose_k_to_finish)."""
  lo = jnp.arange(PROFILE_BUCKETS) * PROFILE_TOKENS                         # [N]
  hi = jnp.where(jnp.arange(PROFILE_BUCKETS) < PROFILE_BUCKETS - 1, lo + PROFILE_TOKENS,
                 jnp.iinfo(jnp.int32).max)
  pos = jnp.asarray(pos_B, jnp.int32)[:, None]
  end = pos + jnp.maximum(jnp.asarray(remaining_B, jnp.int32), 0)[:, None]
  overlap = jnp.maximum(jnp.minimum(hi[None], end) - jnp.maximum(lo[None], pos), 0)
  n = jnp.sum(overlap, 1)
  mean = jnp.sum(overlap * profile_N[None], 1) / jnp.maximum(n, 1)
  return jnp.where(n > 0, mean, profile_weight(profile_N, pos_B)).astype(jnp.float32)


def row_window(ring: ring_lib.Ring, step, window: int, k_max: int, warmup: int = 0,
               profile_N=None):
  """Per row and draft position i, over the last `window` steps: how often the row reached
  position i (trials) and how often it was accepted there (hits). -> (hits, trials) [B, K].
  A row's first `warmup` steps after its insert are left out (DecodeConfig.adapt_warmup). With
  profile_N, each trial counts for g at the row's output position then (profile_weight): hits
  over trials is then a level."""
  r = ring.capacity
  age = (step - 1 - jnp.arange(r)) % r              # 0 = the newest record
  valid = (age < jnp.minimum(window, step))[:, None]                       # [R, 1]
  if warmup:
    valid = valid & (ring.row_step >= warmup)                              # [R, B]
  pos = jnp.arange(k_max)[None, None]                                      # [1, 1, K]
  verified, accepted = ring.verified[..., None], ring.accepted[..., None]  # [R, B, 1]
  trials = valid[..., None] & (verified > pos) & (accepted >= pos)
  hits = trials & (accepted > pos)
  weight = 1.0 if profile_N is None else profile_weight(profile_N, ring.row_pos)[..., None]
  return (jnp.sum(hits, 0).astype(jnp.float32),
          jnp.sum(trials.astype(jnp.float32) * weight, 0))


def window_rates(ring: ring_lib.Ring, step, window: int, k_max: int):
  """Per draft position i: the conditional acceptance rate P(accept i | reached i) over the last
  `window` steps, and the number of trials. -> (rate [K], trials [K])."""
  return pooled_rates(*row_window(ring, step, window, k_max))


def pooled_rates(hits_BK, trials_BK):
  """Per-row window counts pooled over rows -> (rate [K], trials [K])."""
  n_trials = jnp.sum(trials_BK, 0)
  return jnp.sum(hits_BK, 0) / jnp.maximum(n_trials, 1.0), n_trials


def other_rows_rates(hits_BK, trials_BK):
  """Per row, the window counts of all the other rows pooled -> (rate [B, K], trials [B, K]):
  the shared estimate a row's own counts are then weighed against (row_alpha), without counting
  them twice (at one slot there is no other row, and the prior alone is the shared estimate)."""
  n_trials = jnp.sum(trials_BK, 0) - trials_BK
  return (jnp.sum(hits_BK, 0) - hits_BK) / jnp.maximum(n_trials, 1.0), n_trials


def row_alpha(rate_K, trials_K, conf_BK, cut_B, row_hits_BK=None, row_trials_BK=None,
              prior_K=None, gain_B=None):
  """Per row and position, the estimated acceptance probability (0 past the row's cut).

  rate_K, trials_K: the shared windowed rates ([K], or [B, K] per row: see other_rows_rates).
  Each position blends its windowed rate with a prior, by the number of trials it had: the
  prior of position 1 is the head's confidence in this step's draft, that of a later position is
  the estimate of the position before it (so a position never tried yet is expected to do as
  well as the last one tried, and gets tried when that pays). prior_K (rates measured by earlier
  runs of the same decoder; < 0 where unknown) replaces that prior where known: the heads'
  confidence tends to understate how often greedy drafts are accepted. At the first position a
  row whose head is surer than that rate keeps its confidence (text that repeats drafts better
  than the earlier runs' average; less sure says little, as the confidence understates). With
  the row's own window
  counts, that estimate is in turn the prior of the row's own rate (rows differ: some text is
  easier to draft than other), by ROW_PRIOR_TRIALS; at later positions, where a row that drafts
  badly has few trials, the prior is scaled by how the row does at the first position against
  the shared estimate (text that is hard to draft is hard at every position).

  With a profile the inputs are levels (counts weighed by g, the confidence over g at the row's
  position) and gain_B, g where the estimate is for (see future_gain), turns the levels into
  acceptance probabilities.
  """
  lam = trials_K / (trials_K + PRIOR_TRIALS)
  cols, prior = [], conf_BK[:, 0]
  for i in range(conf_BK.shape[1]):
    if prior_K is not None:
      known = prior_K[i] if i else jnp.maximum(prior_K[0], conf_BK[:, 0])
      prior = jnp.where(prior_K[i] >= 0, known, prior)
    a = lam[..., i] * rate_K[..., i] + (1.0 - lam[..., i]) * prior
    cols.append(a)
    prior = a
  alpha = jnp.stack(cols, 1)
  if row_hits_BK is not None:
    t = row_prior_trials(alpha.shape[1])[None]
    first = (row_hits_BK[:, :1] + t[:, :1] * alpha[:, :1]) / (row_trials_BK[:, :1] + t[:, :1])
    prior = jnp.concatenate(
        [alpha[:, :1],
         jnp.clip(alpha[:, 1:] * first / jnp.maximum(alpha[:, :1], 1e-6), 0.0, 1.0)], axis=1)
    alpha = (row_hits_BK + t * prior) / (row_trials_BK + t)
  if gain_B is not None:
    alpha = alpha * gain_B[:, None]
  pos = jnp.arange(conf_BK.shape[1])[None]
  return jnp.where(pos < cut_B[:, None], jnp.clip(alpha, 0.0, 1.0), 0.0)


def row_prior_trials(k_max: int):
  """-> [K]: ROW_PRIOR_TRIALS at the first position, ROW_PRIOR_TRIALS_LATER at the others."""
  return jnp.asarray([ROW_PRIOR_TRIALS] + [ROW_PRIOR_TRIALS_LATER] * (k_max - 1), jnp.float32)


def row_sd(alpha_BK, row_trials_BK):
  """-> [B, K]: the uncertainty of each row's acceptance estimate (row_alpha), a standard
  deviation by the trials behind it: the row's own, plus the row prior's weight of shared
  estimate, each worth 1 / ROW_OVERDISPERSION of an independent trial. With no trials of its
  own, that is about how much rows' true rates spread."""
  n = row_trials_BK + row_prior_trials(alpha_BK.shape[1])[None]
  return jnp.sqrt(ROW_OVERDISPERSION * alpha_BK * (1.0 - alpha_BK) / n)


def finish_sd(alpha_BK, row_trials_BK, remaining_B):
  """-> [B, K]: the spread of the acceptance each row will realise over the steps it has left,
  for choose_k_to_finish: its rate's uncertainty (row_sd) and the scatter of a rate realised
  over h steps around the true one, (overdispersed) binomial noise of variance
  ROW_OVERDISPERSION x a(1 - a) / h, with h the row's remaining tokens over 1 + its first
  position's rate. When a job ends is set by the acceptance its last rows realise, not by
  their means: near the end, with a few dozen steps left, the scatter is as large as the rows'
  spread, and without it the controller drafted the last 30-40 steps at 256 slots, where the
  last rows then emitted 1.35 tokens a step against the 1.4 plain steps each drafting step
  cost."""
  h = jnp.maximum(remaining_B.astype(jnp.float32)[:, None] / (1.0 + alpha_BK[:, :1]), 1.0)
  noise = ROW_OVERDISPERSION * alpha_BK * (1.0 - alpha_BK) / h
  return jnp.sqrt(row_sd(alpha_BK, row_trials_BK) ** 2 + noise)


def row_expected(alpha_BK):
  """-> [B, K+1]: per row, E[emitted tokens | k drafts], k = 0..K (leading axes: any)."""
  run = jnp.cumprod(alpha_BK, axis=-1)                                     # P(first j accepted)
  return 1.0 + jnp.concatenate([jnp.zeros_like(run[..., :1]), jnp.cumsum(run, axis=-1)], axis=-1)


def expected_emitted(alpha_BK, active_B):
  """-> [K+1]: sum over active rows of E[emitted tokens | k drafts], k = 0..K."""
  return jnp.sum(jnp.where(active_B[:, None], row_expected(alpha_BK), 0.0), axis=0)


def choose_k(cost_K1, expected_K1, margin: float = 0.0, allowed_K1=None):
  """argmax_k expected[k] / cost[k]; ties go to the smaller k. With a margin, drafting is chosen
  only when it is expected to beat plain decoding by more than that fraction: the estimates
  carry noise, and a mistaken k > 0 costs more than a missed one gains. allowed_K1 (bool):
  the k that may be chosen (default all)."""
  rate = expected_K1 / cost_K1
  if allowed_K1 is not None:
    rate = jnp.where(allowed_K1, rate, -jnp.inf)
  best = jnp.argmax(rate)
  return jnp.where(rate[best] > rate[0] * (1.0 + margin), best, 0).astype(jnp.int32)


def viable_ks(cost_K1, margin: float = 0.0) -> tuple[int, ...]:
  """The k that the controller may ever choose under this cost table: 0, and each k > 0 that
  would beat plain decoding by more than `margin` if every draft were accepted,
  (k + 1) / c(k) > (1 + margin) / c(0). A row emits at most k + 1 tokens per step, so neither
  objective (choose_k, choose_k_to_finish) can pick any other k; the adaptive loop compiles
  only these variants, and none but plain decoding where the batch makes every step compute
  bound. Host side."""
  c0 = float(cost_K1[0])
  return (0,) + tuple(k for k in range(1, len(cost_K1))
                      if (k + 1) * c0 > (1.0 + margin) * float(cost_K1[k]))


def finish_draws(b: int) -> np.ndarray:
  """-> [FINISH_DRAWS, b]: standard normal draws, one column per row, each column the
  FINISH_DRAWS quantiles at (s + 1/2) / FINISH_DRAWS in an order of its own (a Latin hypercube:
  every row's draws have the exact spread of a normal, and rows are independent)."""
  q = np.asarray([NormalDist().inv_cdf((s + 0.5) / FINISH_DRAWS) for s in range(FINISH_DRAWS)])
  rng = np.random.default_rng(0)
  return np.stack([q[rng.permutation(FINISH_DRAWS)] for _ in range(b)], axis=1)


def choose_k_to_finish(cost_K1, alpha_BK, active_B, remaining_B, margin: float = 0.0,
                       allowed_K1=None, sd_BK=None):
  """When no request waits for a slot, throughput no longer counts, only when the last row
  finishes: the k that minimises max over active rows of remaining_i / E_i[emitted | k] * c(k).
  (A row that drafts well finishing early frees a slot nobody takes, while every step still
  costs c(k) for all slots.) With sd_BK (row_sd), the mean of that max over FINISH_DRAWS draws
  of each row's acceptance, alpha + sd * z with one standard normal z per row and draw (text
  that is hard to draft is hard at every position): the rows that may draft worse than their
  estimates show set the end, and more so the more rows there are and the fewer their trials.
  (finish_sd is the spread the controller gives.) The draws are fixed, so the choice is a
  function of the state. Ties go to the smaller k; k > 0
  only when it is expected to finish sooner than plain decoding by more than `margin` (see
  choose_k; allowed_K1 as there)."""
  rem = remaining_B.astype(jnp.float32)[None, :, None]                       # [1, B, 1]
  if sd_BK is None:
    alpha_SBK = alpha_BK[None]
  else:
    z = finish_draws(alpha_BK.shape[0])[..., None]
    alpha_SBK = jnp.clip(alpha_BK[None] + jnp.asarray(z, jnp.float32) * sd_BK[None], 0.0, 1.0)
  e = row_expected(alpha_SBK)                                                # [S, B, K+1]
  t = jnp.where(active_B[None, :, None], rem / e * cost_K1[None, None], 0.0)
  t = jnp.mean(jnp.max(t, axis=1), axis=0)
  if allowed_K1 is not None:
    t = jnp.where(allowed_K1, t, jnp.inf)
  best = jnp.argmin(t)
  return jnp.where(t[best] * (1.0 + margin) < t[0], best, 0).astype(jnp.int32)
