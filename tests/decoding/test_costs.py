"""Adaptive k's step costs learned from calls (costs.py): the regression, its prior, the clock."""

import time
import types

import numpy as np

from mtp_jax.config import DecodeConfig
from mtp_jax.decoding import costs as C
from mtp_jax.decoding import shape_set

ROWS = [1, 2, 3, 4, 9]          # chains 0..3, then a tree of 8 nodes


def _truth(c0=1e-3, per_row=0.4):
  return np.asarray([c0 * (1.0 + per_row * (r - 1)) for r in ROWS])


def _calls(model, truth, mixes, rng, overhead=5e-5, noise=0.03):
  for steps in mixes:
    steps = np.asarray(steps, float)
    model.observe(steps, float(steps @ truth + overhead) * (1 + noise * rng.standard_normal()))


def test_costs_are_learned_from_calls_of_mixed_shapes():
  """A flat (memory-bound) prior 40% off; calls of 8-32 steps mixing shapes: each shape run is
  learned within a few percent, the call's own cost apart."""
  rng = np.random.default_rng(0)
  truth = _truth()
  model = C.CostModel([1e-3] * 4 + [1.05e-3], ROWS)
  mixes = [rng.multinomial(rng.integers(8, 33), [0.4, 0.2, 0.1, 0.3, 0.0]) for _ in range(40)]
  _calls(model, truth, mixes, rng)
  np.testing.assert_allclose(model.mean[:4], truth[:4], rtol=0.05)
  assert np.all(model.sd[:4] < 0.2 * truth[:4])          # 10% noise a call, ~20 calls kept


def test_a_shape_never_run_is_priced_from_what_its_rows_cost():
  """Only plain steps and chains of 3 ran: the shared cost of a row past the first prices the
  tree of 9 rows far above the flat prior, with an error wider than the shapes that ran."""
  rng = np.random.default_rng(1)
  truth = _truth()
  model = C.CostModel([1e-3] * 5, ROWS)
  _calls(model, truth, [[32, 0, 0, 0, 0], [0, 0, 0, 32, 0], [16, 0, 0, 16, 0]] * 6, rng)
  assert model.mean[4] > 2.0e-3 and abs(model.mean[4] / truth[4] - 1) < 0.3, model.mean
  assert model.sd[4] > 3 * model.sd[3]
  opt = model.optimistic(3)
  assert np.all(np.asarray(opt) <= model.mean + 1e-12) and np.all(np.diff(opt[:4]) >= 0)


def test_stored_costs_start_the_next_model():
  rng = np.random.default_rng(2)
  model = C.CostModel([1e-3] * 5, ROWS)
  _calls(model, _truth(), [[8, 8, 8, 8, 0]] * 10, rng)
  again = C.from_stored(model.stored(), ROWS)
  np.testing.assert_allclose(again.mean, model.mean, rtol=1e-6)
  assert np.all(again.sd >= 0.1 * again.mean * 0.99)        # no surer than processes agree


def test_the_clock_dates_calls_the_drain_waited_for():
  """A call runs from its launch to the end of the drain that waited for it; a drain that finds
  its call done dates nothing, and the call after it counts from its own launch; a call
  launched while the one before runs starts where that one ends."""
  clock = C.CallClock()
  clock.launched()
  _, s = clock.drained(lambda: time.sleep(0.02))
  assert 0.019 < s < 0.05
  clock.launched()
  _, s = clock.drained(lambda: None)                       # done before the drain: no date
  assert s is None
  time.sleep(0.005)
  clock.launched()
  clock.launched()                                         # queued behind the first
  _, s = clock.drained(lambda: time.sleep(0.01))
  assert 0.009 < s < 0.03
  time.sleep(0.02)                                         # host work; the device runs on
  _, s = clock.drained(lambda: time.sleep(0.01))
  assert 0.029 < s < 0.05           # from the first's end (not its own launch) to the drain's


def test_the_first_shape_is_the_best_chain_at_the_prior():
  eng = types.SimpleNamespace(kd=3, cost=[1.0, 1.01, 1.02, 1.03], shape_set=shape_set.ShapeSet(3),
                              cfg=DecodeConfig(adaptive=True))
  assert C.first_shape(eng) == 3                           # memory bound: the deepest chain
  eng.cost = [1.0, 2.0, 3.0, 4.0]
  assert C.first_shape(eng) == 0                           # compute bound: plain decoding
  eng.cost = [1.0, 1.2, 1.9, 2.6]
  assert C.first_shape(eng, [0.9, 0.2, 0.2]) == 1
