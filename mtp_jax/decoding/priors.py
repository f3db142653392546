"""Adaptive k's prior: what earlier requests of the same weights accepted, and what it counts for.

The controller blends the window's rate at each draft position with a prior (adaptive.blend). The
prior is the conditional acceptance this decoder's earlier requests measured there, their counts
pooled (one hard request does not set the next run's prior), and it counts for m pseudo-trials,
from how far the requests' own rates scatter around the pool (empirical Bayes, beta-binomial
moments, as adaptive.row_prior_trials weighs the pool in a row's estimate): the text at hand is
one more request, so where requests accept alike the pool counts for many trials (as many as a
scatter within its own error allows), and where they differ for few, so that the window's counts
of the request at hand soon outweigh it (per active row of the window's: adaptive.prior_weight).
With fewer than two requests measured at a position, nothing says how alike they are: the one
request counts as a guess does, for one window (at most its own trials). A position no request
measured takes a guess instead (the head's confidence, the estimate of the position before),
counting for one window (init_controller).

Greedy and sampled runs keep apart (rejection sampling accepts less). A later process starts from
the first position's rate and weight, stored beside the cost table (tables.save_rates). Host side.
"""

from __future__ import annotations

import weakref

import numpy as np

from mtp_jax.decoding import tables


def prior_trials(n_J, s1, s2, inv_n, trials, hits, alone: float):
  """-> [K]: the pseudo-trials the pooled rate hits / trials counts for, per position, from the
  requests' moments there: n_J requests measured (trials > 0), the sums of their rates r_j, of
  r_j^2 and of 1 / trials_j. True rates spread around the pool's p with variance
  tau^2 = p (1 - p) / (m + 1); tau^2 is the requests' scatter less their binomial noise, taken
  at least its own standard error (~ the noise times sqrt(2 / J) over J requests): scatter too
  small to tell from the noise bounds m, it does not make the prior count for every trial the
  pool holds, which would keep the window from ever moving it (text unlike the earlier
  requests', another process's). Fewer than two requests: `alone` (what a guess counts for: a
  measured rate counts for no less); at most the pool's trials, at least 1."""
  n_J, trials = np.asarray(n_J, float), np.asarray(trials, float)
  j = np.maximum(n_J, 1.0)
  p = np.asarray(hits, float) / np.maximum(trials, 1.0)
  pq = p * (1.0 - p)
  scatter = (np.asarray(s2) - 2.0 * p * np.asarray(s1)) / j + p * p
  noise = pq * np.asarray(inv_n) / j
  tau2 = np.maximum(scatter - noise, noise * np.sqrt(2.0 / j))
  with np.errstate(divide="ignore", invalid="ignore"):
    m = np.where(tau2 > 0, pq / np.maximum(tau2, 1e-12) - 1.0, trials)
  m = np.where(n_J >= 2, m, alone)
  return np.clip(m, 1.0, np.maximum(trials, 1.0))


class Counts:
  """One kind of run's (greedy or sampled) acceptance counts, per draft position: pooled over
  its requests, and the moments of the requests' own rates (prior_trials)."""

  def __init__(self, kd: int, alone: float):
    self.sums = np.zeros((6, kd))    # requests measured, sum r, sum r^2, sum 1/n, trials, hits
    self.alone = alone               # the weight of one request's rate (prior_trials)

  def add(self, trials_JK, hits_JK):
    """Adds finished requests' counts [J, Kd] (drafts reached per position, accepted there)."""
    n = np.asarray(trials_JK, float).reshape(-1, self.sums.shape[1])
    h = np.asarray(hits_JK, float).reshape(n.shape)
    on = n > 0
    r = np.where(on, h / np.maximum(n, 1.0), 0.0)
    self.sums += np.stack([on.sum(0), r.sum(0), (r * r).sum(0),
                           np.where(on, 1.0 / np.maximum(n, 1.0), 0.0).sum(0), n.sum(0),
                           h.sum(0)])

  def prior(self) -> tuple[list[float], list[float]]:
    """-> (rates, pseudo-trials) per position; rate -1 where fewer than 16 drafts were reached
    (tables.run_rates)."""
    trials, hits = self.sums[4], self.sums[5]
    return tables.run_rates(trials, hits), prior_trials(*self.sums, self.alone).tolist()


class Priors:
  """A decoder's priors: its runs' counts, greedy (False) and sampled (True) apart, and where
  they are stored for later processes (set by Decoder.cost_table). window: what a guess counts
  for in the controller (DecodeConfig.accept_window), and so a rate one request measured."""

  def __init__(self, kd: int, window: float):
    self.kd, self.window = kd, float(window)
    self.counts: dict[bool, Counts] = {}
    self.path: str | None = None
    self.keys: dict[bool, str] = {}       # the tables file's key of each kind of run
    self._stored: dict[bool, tuple] = {}  # priors to store (each kind after its first run)

  def start(self, sampled: bool) -> tuple[list[float] | None, list[float] | None]:
    """-> (rates, pseudo-trials) for a run's controller: this decoder's runs' so far, else the
    stored first position's (positions past it are tried only where the controller drafts that
    far, so a low rate stored for them by other text could keep this run from ever drafting that
    far; unknown, they start from the first position's estimate), else (None, None)."""
    c = self.counts.get(sampled)
    if c is not None:
      rates, m = c.prior()
      if max(rates, default=-1.0) >= 0:
        return rates, m
    if self.path and sampled in self.keys and self.kd > 0:
      stored = tables.load_rates(self.path, self.keys[sampled])
      if stored is not None and len(stored[0]) == self.kd and stored[0][0] >= 0:
        rest = [-1.0] * (self.kd - 1)
        return [stored[0][0]] + rest, [stored[1][0]] + [1.0] * (self.kd - 1)
    return None, None

  def learn(self, sampled: bool, trials_JK, hits_JK):
    """Adds a run's finished requests; stores the prior after the first run of each kind, and
    the last one once the decoder is collected or the process exits (a file write per run is a
    few percent of a short run)."""
    c = self.counts.setdefault(sampled, Counts(self.kd, self.window))
    c.add(trials_JK, hits_JK)
    rates, m = c.prior()
    if not self.path or sampled not in self.keys or max(rates, default=-1.0) < 0:
      return
    first = sampled not in self._stored
    if not self._stored:
      weakref.finalize(self, _store, self.path, self.keys, self._stored)
    self._stored[sampled] = rates, m
    if first:
      _store(self.path, self.keys, {sampled: (rates, m)})


def _store(path: str, keys: dict[bool, str], priors: dict[bool, tuple]):
  for sampled, (rates, m) in list(priors.items()):
    tables.save_rates(path, keys[sampled], rates, m)
