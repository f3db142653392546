"""What a step of each shape costs, learned while serving: adaptive k's cost table without a wait.

Before a run has timed anything, a step of shape s costs what it reads and computes against the
machine's measured roofs (roofline.py): c(s) = max(bytes(s) / bandwidth, FLOPs(s) / FLOP rate),
or, where an earlier process of the same device, model, slots and code stored what it learned,
that (tables.py). Neither is trusted far: the roofline ignores what keeps a small product from
its roof (XLA:CPU packs a GEMM of 2-16 rows at 1.5-2.2x a GEMV's time; an accelerator launches
kernels), and machines drift. Each `generate` call then tells what its steps cost together: its
time T and the steps n_s of each shape it ran (the drained ring's k_used), T = sum_s n_s c(s) + o
(o: the call's own cost). CostModel is the Bayesian linear regression of T on n with the prior
above (relative error `prior_sd`) and an error of `noise` T per call, past calls discounted by
`forget` per call so that the costs follow the rows' growing context and the machine's drift.

The controller weighs the costs one standard error below their estimate (`optimistic`): a shape
the prior or a few calls say could beat the current one gets run, and its own calls then pin its
cost down (the error of a shape never run stays the prior's). Host side.
"""

from __future__ import annotations

import collections
import time

import jax
import numpy as np

from mtp_jax.decoding import programs, roofline, shape_set, tables


class CostModel:
  """Seconds per step of each of S shapes, learned from calls' times.

  c(s) = a x_s + b y_s + d_s: x_s the prior's cost of shape s, y_s its rows past the first
  (tokens a row verifies less one) times the prior's plain step, d_s the shape's own deviation.
  a (the prior's scale, 1 +- prior_sd) and b (what a row past the first adds, 0 +- prior_sd of a
  plain step) are shared, so that a run of plain steps and one chain tells what a tree would
  cost (XLA:CPU: a product of 2-16 rows costs 1.5-2.2 rows); d_s (0 +- shape_sd x_s) is learned
  only from the shape's own steps. A call adds o (0 +- one plain step)."""

  def __init__(self, prior_S, rows_S, prior_sd: float = 0.5, shape_sd=0.2,
               noise: float = 0.1, forget: float = 0.95):
    """prior_S: seconds per step of each shape before any call; rows_S: the tokens a row
    verifies in a step of each shape; shape_sd: each shape's own relative error (one, or per
    shape)."""
    x = np.maximum(np.asarray(prior_S, np.float64), 1e-9)
    y = (np.asarray(rows_S, np.float64) - 1.0) * x[0]
    s = len(x)
    # theta = [a, b, d_0 .. d_{S-1}, o];  c = m @ theta
    self.m = np.concatenate([x[:, None], y[:, None], np.eye(s), np.zeros((s, 1))], 1)
    sd = np.concatenate([[prior_sd, prior_sd], np.asarray(shape_sd) * x * np.ones(s), [x[0]]])
    self.mu0 = np.concatenate([[1.0, 0.0], np.zeros(s), [0.0]])
    self.prec0 = np.diag(1.0 / sd ** 2)
    self.a = np.zeros_like(self.prec0)                 # the calls' precision, discounted
    self.b = np.zeros_like(self.mu0)
    self.prior = x
    self.noise, self.forget = noise, forget
    self.calls = 0

  def observe(self, steps_S, seconds: float):
    """One call of steps_S[s] steps of shape s that took `seconds`."""
    x = np.concatenate([np.asarray(steps_S, np.float64) @ self.m[:, :-1], [1.0]])
    w = 1.0 / (self.noise * max(seconds, 1e-9)) ** 2
    self.a = self.forget * self.a + w * np.outer(x, x)
    self.b = self.forget * self.b + w * x * seconds
    self.calls += 1

  def _posterior(self):
    cov = np.linalg.inv(self.prec0 + self.a)
    theta = cov @ (self.prec0 @ self.mu0 + self.b)
    return self.m @ theta, self.m @ cov @ self.m.T

  @property
  def mean(self) -> np.ndarray:
    """[S] seconds per step (at least a tenth of the prior)."""
    return np.maximum(self._posterior()[0], 0.1 * self.prior)

  @property
  def sd(self) -> np.ndarray:
    return np.sqrt(np.maximum(np.diag(self._posterior()[1]), 0.0))

  def optimistic(self, kd: int) -> list[float]:
    """[S] the costs the controller weighs: below the estimate by as much as its standard error
    exceeds a call's noise (a shape little run gets tried; one known to within the noise is
    taken as it is, or drafting that does not pay would be chosen for its error), the chains'
    (shapes 0..kd) made non-decreasing in k (tables.monotone)."""
    mean = self.mean
    c = np.maximum(mean - np.maximum(self.sd - self.noise * mean, 0.0), 0.5 * mean)
    return tables.monotone(list(c[:kd + 1])) + list(c[kd + 1:])

  def stored(self) -> dict:
    """What a later process starts from (from_stored)."""
    return {"cost_s": [float(x) for x in self.mean],
            "rel_sd": [round(float(x), 4) for x in self.sd / self.mean], "calls": self.calls}


def from_stored(entry: dict, rows_S, floor: float = 0.1, **kw) -> CostModel:
  """A CostModel from a stored one: its costs as the prior, the scale and the rows' cost known
  to `floor` (processes on one machine differ by about 10%), each shape to its stored error
  and no less than `floor`."""
  sd = np.maximum(np.asarray(entry.get("rel_sd", [0.5] * len(entry["cost_s"])), float), floor)
  return CostModel(entry["cost_s"], rows_S, prior_sd=floor, shape_sd=sd, **kw)


def rows(engine) -> list[int]:
  """[S] the tokens a row verifies in a step of each of engine's shapes."""
  return [engine.shape(s).size + 1 for s in range(engine.n_shapes)]


def roofline_prior(engine, params, roofs: tuple[float, float]) -> list[float]:
  """[S] seconds per step of each shape of `engine` from its bytes and FLOPs (roofline.step_cost,
  rows about the middle of the cache) against the roofs (bytes/s, FLOP/s)."""
  bw, flops = roofs
  m, h, d = engine.model_cfg, engine.heads_cfg, engine.cfg
  p, draft = (params, None) if d.drafter != "model" else params
  dm = None if engine.draft_cfg is None else engine.draft_cfg[0]
  out = []
  for s in range(engine.n_shapes):
    shape = engine.shape(s)
    k = shape.size if s > engine.kd else s          # a tree verifies its T nodes
    nbytes, nflops = roofline.step_cost(m, h, d, k, d.batch_size, p, draft, dm,
                                        kv_positions=d.max_len / 2)
    out.append(max(nbytes / bw, nflops / flops))
  return out


_ROOFS: dict = {}


def machine_roofs(path: str | None) -> tuple[float, float]:
  """(bytes/s, FLOP/s) of this machine and runtime: measured once (under a second on a CPU),
  then kept in the process and in the tables file at path."""
  dev = jax.devices()[0]
  key = f"roofs|{dev.platform}:{getattr(dev, 'device_kind', '')}|{tables.runtime()}"
  entry = _ROOFS.get(key) or (tables.load_entry(path, key) if path else None)
  if entry is None:
    bw, flops = roofline.measure_roofs(dev.platform, matmul_n=1024)     # 0.2 s sooner
    entry = {"bandwidth": bw, "flops": flops}
    if path:
      tables.save_entry(path, key, entry)
  _ROOFS[key] = entry
  return float(entry["bandwidth"]), float(entry["flops"])


class CallClock:
  """The device time of each generate call, from the host. A call starts when its launch
  returns (compiling, where it compiles, is done by then: the run itself is asynchronous) or
  when the call before it ends, whichever is later, and ends when the drain that waits for it
  returns. A drain that did not wait dates nothing (the call ended before it); the call after
  it is dated only if it was launched after that drain began (the device was idle then)."""

  def __init__(self):
    self.launches: collections.deque = collections.deque()
    self.prev_end = 0.0          # when the call before ended (None: not known)
    self.t0_prev = 0.0           # when the drain before began

  def launched(self):
    self.launches.append(time.perf_counter())

  def drained(self, fn):
    """Runs the drain of the oldest call launched (fn); -> (fn's result, the call's seconds or
    None)."""
    t0 = time.perf_counter()
    out = fn()
    end = time.perf_counter()
    launch = self.launches.popleft()
    start = None if self.prev_end is None else max(launch, self.prev_end)
    if self.prev_end is None and launch >= self.t0_prev:
      start = launch
    waited = end - t0 > 2e-4
    seconds = end - start if start is not None and waited else None
    self.prev_end, self.t0_prev = (end if waited else None), t0
    return out, seconds


# A shape not compiled is compiled once the controller has wanted it in this many segments (a
# call's worth of steps) and in this share of all its choices: a compile costs seconds (and,
# behind the run, slows it meanwhile), and a shape wanted now and then gains little.
OPEN_AFTER, OPEN_SHARE = 8, 0.25
# The calls whose wishes are not counted: their costs were the prior's (a roofline prices a tree
# like a chain where a step is memory bound; XLA:CPU's products of several rows are not).
LEARN_FIRST = 2


class Learner:
  """Adaptive k's host side for one engine: the cost model and the calls' clock, the costs the
  controller weighs (engine.cost), the shapes compiled (engine.opened: the chains the prior
  leaves viable, then those the controller wants), and where the costs are kept (path; None:
  this process)."""

  def __init__(self, engine, params, path: str | None = None, fresh: bool = False,
               rates=None):
    """fresh: start from the roofline, not the stored costs. rates: the acceptance per draft
    position to choose the first shape with (-1 or None: unknown, taken as 0.5)."""
    self.engine, self.path = engine, path
    self.key = tables.table_key(engine)
    stored = None if fresh or not path else tables.load_table(path, self.key, engine.n_shapes)
    self.model = (from_stored(stored, rows(engine)) if stored else
                  CostModel(roofline_prior(engine, params, machine_roofs(path)), rows(engine)))
    self.clock = CallClock()
    self.wanted = np.zeros((engine.n_shapes,), np.int64)     # segments wanted, all runs
    self.run_wanted = np.zeros_like(self.wanted)              # the run's so far
    engine.cost = self.model.optimistic(engine.kd)
    engine.opened = set()
    engine.open([first_shape(engine, rates)] + viable_chains(engine))
    if engine.programs is None:
      engine.programs = programs.Programs(engine._generate)

  def launched(self):
    """A generate call was just launched (its compile, if any, done)."""
    self.clock.launched()

  def drained(self, eng, fn):
    """Runs a drain (fn: its records, the controller's wanted counts last where eng is
    adaptive), learns from the call's time (unless a program compiled beside it) and opens the
    shapes the controller wanted in OPEN_AFTER segments and OPEN_SHARE of its choices or more.
    -> the records."""
    out, seconds = self.clock.drained(fn)
    k_used = np.asarray(out[2])
    busy = self.engine.programs is not None and self.engine.programs.busy
    if seconds is not None and len(k_used) and not busy:   # a compile beside it: not a step's cost
      self.model.observe(np.bincount(k_used, minlength=self.engine.n_shapes), seconds)
      self.engine.cost = self.model.optimistic(self.engine.kd)
    if eng.cfg.adaptive:
      now = np.asarray(out[-1], np.int64)          # the run's counts so far
      if self.model.calls > LEARN_FIRST:            # wishes made on the prior alone do not count
        self.wanted += np.maximum(now - self.run_wanted, 0)
      self.run_wanted = np.maximum(now, self.run_wanted)
      often = (self.wanted >= OPEN_AFTER) & (self.wanted >= OPEN_SHARE * self.wanted.sum())
      self.engine.open(np.nonzero(often)[0])
      out = out[:-1]
    return out

  def run_started(self):
    self.run_wanted[:] = 0           # the controller's counts start again with each run's state

  def save(self):
    if self.path:
      tables.save_table(self.path, self.key, self.model.stored())


def viable_chains(engine) -> list[int]:
  """The chains that could beat plain decoding by the margin at engine.cost were every draft
  accepted, (k + 1) c(0) > (1 + margin) c(k): compiled from the start (behind the first
  program), the others only once the controller wants them."""
  c, margin = engine.cost, engine.cfg.adapt_margin
  return [k for k in range(1, engine.kd + 1) if (k + 1) * c[0] > (1.0 + margin) * c[k]]


def first_shape(engine, rates=None) -> int:
  """The chain the controller would choose at engine.cost with every row at `rates` (unknown:
  0.5), plain decoding unless another beats it by the margin: the one compiled first (a tree
  only once the chains' costs have shown what its rows cost)."""
  kd = engine.kd
  rates = [-1.0] * kd if rates is None else rates
  alpha = np.asarray([r if r >= 0 else 0.5 for r in rates], np.float32)
  ss = engine.shape_set or shape_set.ShapeSet(kd)
  rate = (np.asarray(ss.expected(alpha)) / np.asarray(engine.cost, np.float64))[:kd + 1]
  best = int(np.argmax(rate))
  return best if rate[best] > rate[0] * (1.0 + engine.cfg.adapt_margin) else 0
