"""The loops of one `generate` call: steps in `lax.while_loop`s on the device, state carried.

A fixed-k engine runs one loop of its step. Adaptive k runs segments of adapt_every steps whose
k the controller chooses at the start of each (segments run across calls: the step count tells
where one is). A drafting step drafts its own k and the first draft's confidence (what the
controller reads); where the controller raises k, the first step of the larger k verifies the
drafts there are (n_fresh), and the controller estimates the positions past a row's fresh
drafts from the rates and the prior (controller_limit). A plain segment drafts nothing,
except a probe segment: its last two steps draft one head each, and a plain step holding a fresh
draft checks it against the token it chose (step._shadow_check: what a step of one draft would
have accepted, nothing committed), so that the controller sees real acceptance in the window and
fresh confidences when acceptance may have recovered, at the cost of the heads' work alone.
(Confidences alone keep a controller that began plain there: the heads' peak probability
understates how often their drafts are accepted, and nothing else would ever be verified.) Probes
come every probe_gap plain segments, and only where one could lead to drafting: some k beats
plain decoding at the rates one standard error above their estimates (adaptive.worth_probing;
else plain decoding runs to the end of the call); the gap doubles after each probe that leads to
no drafting (up to probe_every_max); after a drafting segment it is accept_window steps (in
segments): the turn to plain decoding is checked again once the rates that made it have left
the window.

An adaptive call runs rounds of four loops, in order, each step a fixed-k engine's own step:
1. one loop per drafting shape of ks (k > 0, then adaptive k's trees), the largest index first,
   each running while the controller keeps to its k (checked by a lax.cond where a segment ends);
2. plain segments up to the start of the next probe segment: with no fresh drafts the controller
   can only choose 0 again;
3. the probe loop: probe segments (plain steps, the last two drafting one head), while the
   controller keeps to plain decoding; it stops where a drafting segment or a plain run would
   begin;
4. that plain run, as in 2.
Where the controller raises k past the loops already run (a probe that leads to drafting, a k
raised above the loop's), the next round runs it, in the same call; the call ends after its
num_steps steps, where no row goes on, or after a round that ran no step. Why loops: a
lax.switch over variants gives each branch a copy of every buffer it updates (the whole KV cache,
every step); a while_loop updates its carry in place. Why loops that run while the controller
keeps to a shape, and not a loop of segments: nested in a segment loop (entered every
adapt_every steps), the same steps ran 4-8% slower on XLA:CPU; a round is entered where the
shape changes. The controller is asked only where its answer can change what runs (a lax.cond
around each evaluation): choose_k where a row holds fresh drafts (without one plain decoding is
the cheapest shape), worth_probing where a probe is due within the call; a call inside a plain
run asks nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import adaptive
from mtp_jax import step as step_lib
from mtp_jax.state import DecodeState


def _set_controller(state: DecodeState, **values) -> DecodeState:
  return state.replace(controller=state.controller.replace(**values))


def _lazily(ask, evaluate, default=False):
  """evaluate() where ask, else default: the controller's evaluations (choose_k, worth_probing)
  cost ~100 us a pair on XLA:CPU at 4 slots, about an eighth of a plain step, and a call inside
  a plain run needs none."""
  return jax.lax.cond(ask, evaluate, lambda: jnp.asarray(default))


def controller_limit(eng, state: DecodeState):
  """Per row, the drafts the controller may expect it to verify: none without a fresh draft
  (a plain step drafts nothing), the threshold's cut where it falls within the fresh drafts,
  else all Kd: a probe drafts only the first head, and the positions past it are estimated
  from the ring's rates and the prior (adaptive.estimate), as for any position that has no
  draft yet."""
  lim = step_lib.row_limit(eng.step_cfg, state.drafts)
  fresh = state.drafts.n_fresh
  return jnp.where((fresh > 0) & (lim >= fresh), eng.kd, lim).astype(jnp.int32)


def allowed(eng, state: DecodeState, ks: tuple[int, ...]):
  """-> [n_shapes] bool: the shapes of ks the controller may choose for the segment that begins
  at state: a chain always (every row keeps Kd+1 positions free); a tree of T nodes only where
  the longest active row, grown by Kd+1 tokens in each of the segment's other steps, still has T
  positions past its last token (rows keep no room for adaptive k's trees, so a long context
  keeps every position a chain can use)."""
  n, kd = eng.n_shapes, eng.kd
  size = np.asarray([eng.shape(i).size for i in range(n)])
  longest = jnp.max(jnp.where(state.rows.done, 0, state.rows.length))
  reach = longest + (eng.cfg.adapt_every - 1) * (kd + 1)
  room = (jnp.arange(n) <= kd) | (reach + size <= eng.cfg.max_len)
  return jnp.isin(jnp.arange(n), jnp.asarray(ks)) & room


def choose_k(eng, state: DecodeState, ks: tuple[int, ...], closed, allowed_S=None):
  """The controller's shape index for the segment, on the device (adaptive.choose), one of ks
  that `allowed` leaves (allowed_S: already computed). closed: no request will take a slot."""
  allowed_S = allowed(eng, state, ks) if allowed_S is None else allowed_S
  return adaptive.choose(state, controller_limit(eng, state), allowed_S, eng.cfg.accept_window,
                         eng.cfg.adapt_margin, eng.shape_set, closed)


def worth_probing(eng, state: DecodeState, ks: tuple[int, ...]):
  """Whether a probe could lead the controller to draft (adaptive.worth_probing)."""
  allowed_S = jnp.isin(jnp.arange(eng.n_shapes), jnp.asarray(ks))
  return adaptive.worth_probing(state, allowed_S, eng.cfg.accept_window, eng.cfg.adapt_margin,
                                eng.shape_set)


class Loop:
  """One traced generate call: the engine, the bound models and the call's arguments."""

  def __init__(self, eng, m, dm, state: DecodeState, num_steps, refill, idle_steps, closed,
               sample: bool, ks):
    self.eng, self.m, self.dm, self.sample, self.ks = eng, m, dm, sample, ks
    # Drafts hold each head's top candidates only where a tree may verify them.
    self.ranked = ks is None or max(ks) > eng.kd
    self.num_steps, self.refill, self.idle_steps = num_steps, refill, idle_steps
    self.closed = closed             # no request will take a slot: the end of the job counts
    self.done0, self.step0, self.row_steps0 = state.rows.done, state.record.step, state.rows.steps
    self.every = eng.cfg.adapt_every
    self.zero = jnp.zeros((), jnp.int32)

  def goes_on(self, st: DecodeState):
    """Some row is active and, with refill > 0 (requests wait for slots), the host is not yet
    better off refilling: fewer than refill rows finished in this call, and the slots they
    freed have stood idle for fewer than idle_steps slot-steps in all (Engine.generate)."""
    freed_B = st.rows.done & ~self.done0
    n_freed = jnp.sum(freed_B.astype(jnp.int32))
    # A freed row's idle steps: the call's steps minus the ones it was active in.
    idle_B = (st.record.step - self.step0) - (st.rows.steps - self.row_steps0)
    idle = jnp.sum(jnp.where(freed_B, idle_B, 0))
    wait = (n_freed < self.refill) & ((n_freed == 0) | (idle < self.idle_steps))
    return ~jnp.all(st.rows.done) & ((self.refill == 0) | wait)

  def steps(self, j, i, st, k: int, nd, go, want_conf: bool = True):
    """Steps of k drafts (nd made) while go(j) and the call goes on; j counts them on top of
    the caller's j, i the call's steps. -> (j, i, st)."""
    def run(c):
      return go(c[0]) & (c[1] < self.num_steps) & self.goes_on(c[2])

    def body(c):
      st = self.eng.step(self.m, c[2], k, self.sample, nd, dm=self.dm, want_conf=want_conf,
                         ranked=self.ranked)
      return c[0] + 1, c[1] + 1, st
    return jax.lax.while_loop(run, body, (j, i, st))

  def fixed(self, st: DecodeState, k: int, nd) -> DecodeState:
    return self.steps(self.zero, self.zero, st, k, nd, lambda j: True)[2]

  # ------------------------------------------------------------------ adaptive k

  def adaptive(self, state: DecodeState) -> DecodeState:
    if max(self.ks) == 0:   # no k can pay under the cost table (adaptive.viable_ks): plain
      return self.fixed(state, 0, 0)

    def round_(c):
      """The four loops once, from the shape index kc the controller chose."""
      i, kc, st, _ = c
      i0 = i
      i, kc, st = self.drafting(i, kc, st)
      i, st = self.plain(i, kc, st)
      # The probe loop's carry: (i, the k it stopped at (-1: none yet), st).
      i, k_stop, st = jax.lax.while_loop(
          lambda c: (c[1] < 0) & (c[0] < self.num_steps) & self.goes_on(c[2]),
          self.probe_segment, (i, jnp.asarray(-1, jnp.int32), st))
      # Where it stopped at a plain run (after a probe that found nothing worth drafting), the
      # run follows, up to the next probe.
      i, st = self.plain(i, k_stop, st)
      return i, k_stop, st, i > i0

    # Rounds while the call goes on: where the probe loop leads to drafting, the next round's
    # drafting loops run it. A round that ran no step ends the call.
    return jax.lax.while_loop(
        lambda c: c[3] & (c[0] < self.num_steps) & self.goes_on(c[2]), round_,
        (self.zero, self.choose(state), state, jnp.asarray(True)))[2]

  def choose(self, st: DecodeState):
    """The k of the segment st's step begins, or continues: a call that begins inside a
    drafting segment continues it (k is chosen once per segment; inside a plain segment it
    chooses again: rows inserted since bring fresh drafts)."""
    c = st.controller
    ok_S = allowed(self.eng, st, self.ks)
    cont = ((st.record.step % self.every > 0) & (c.seg_k > 0) & (c.k_force < 0) & ok_S[c.seg_k])
    # Without a fresh draft every shape expects one token a row, and only a shape that costs
    # less than a plain step (by the margin) could be chosen: the controller is asked only where
    # a row holds fresh drafts, k is forced, or the cost table has such a shape.
    cheaper = jnp.any(c.cost[1:] * (1.0 + self.eng.cfg.adapt_margin) < c.cost[0])
    ask = jnp.any(~st.rows.done & (st.drafts.n_fresh > 0)) | (c.k_force >= 0) | cheaper
    chosen = _lazily(~cont & ask, lambda: choose_k(self.eng, st, self.ks, self.closed, ok_S),
                     self.zero)
    return jnp.where(cont, c.seg_k, chosen)

  def drafting(self, i, kc, st: DecodeState):
    """Loop 1: one loop per drafting shape (k > 0, then trees), the largest index first, from
    the shape index kc. -> (i, the shape index the call goes on with, st)."""
    every = self.every
    after_drafting = min(-(-self.eng.cfg.accept_window // every), self.eng.cfg.probe_every_max)

    def steady(k: int):
      k_ = jnp.asarray(k, jnp.int32)

      def body(c):
        i, _, st = c
        st = self.eng.step(self.m, st, k, self.sample, self.eng.depth(k), dm=self.dm,
                           want_conf=True, ranked=self.ranked)
        nk = jax.lax.cond(st.record.step % every == 0,
                          lambda s: choose_k(self.eng, s, self.ks, self.closed), lambda s: k_, st)
        return i + 1, nk, st
      return body

    i_start, seg = i, st.controller.seg_k
    for k in sorted(self.ks[1:], reverse=True):
      i0 = i
      i, kc, st = jax.lax.while_loop(
          lambda c, k=k: (c[1] == k) & (c[0] < self.num_steps) & self.goes_on(c[2]), steady(k),
          (i, kc, st))
      seg = jnp.where(i > i0, k, seg)
    ran = i > i_start
    c = st.controller
    st = _set_controller(st, probe_gap=jnp.where(ran, after_drafting, c.probe_gap),
                         plain_segs=jnp.where(ran, 0, c.plain_segs), seg_k=seg)
    return i, kc, st

  def plain(self, i, k, st: DecodeState):
    """Plain segments that do not probe draft nothing, and with no fresh drafts the controller
    can only choose 0 again: where k is 0 they run in one top-level loop up to the start of the
    probe segment (a k forced to plain decoding, as when the cost table is measured: to the end
    of the call). -> (i, st)"""
    every, c = self.every, st.controller
    phase = st.record.step % every
    # No probe is due where none could lead to drafting (forced, or not worth_probing); asked
    # only where a probe is due within the call (else the run ends at the call's end either way).
    to_probe = every * (c.probe_gap - 1 - c.plain_segs) - phase
    ask = (k == 0) & (c.k_force < 0) & (i < self.num_steps) & (to_probe < self.num_steps - i)
    to_end = (c.k_force >= 0) | ~_lazily(ask, lambda: worth_probing(self.eng, st, self.ks))
    run = (k == 0) & (to_end | (c.plain_segs + 1 < c.probe_gap))
    n_run = jnp.where(to_end, self.num_steps - i, to_probe)
    j, i, st = self.steps(self.zero, i, st, 0, 0, lambda j: run & (j < n_run), want_conf=False)
    c = st.controller
    return i, _set_controller(st, plain_segs=c.plain_segs + (phase + j) // every,
                              seg_k=jnp.where(j > 0, 0, c.seg_k))

  def probe_segment(self, carry):
    """Loop 3's body: one probe segment where the controller keeps to plain decoding and a
    probe is due; else nothing, and the k to stop at."""
    i, _, st = carry
    every = self.every
    phase = st.record.step % every
    k = self.choose(st)
    c = st.controller
    due = (k == 0) & (c.plain_segs + 1 >= c.probe_gap) & (c.k_force < 0)
    probe = due & _lazily(due, lambda: worth_probing(self.eng, st, self.ks))
    n_run = every - phase                      # steps to the end of the segment
    j, i, st = self.steps(self.zero, i, st, 0, 0, lambda j: probe & (j < n_run - 2),
                          want_conf=False)
    j, i, st = self.steps(j, i, st, 0, 1, lambda j: probe & (j < n_run), want_conf=True)
    ended = (phase + j) // every               # segments completed
    c = st.controller
    gap = jnp.minimum(2 * c.probe_gap, self.eng.cfg.probe_every_max)
    return i, jnp.where(probe, -1, k), _set_controller(
        st, probe_gap=jnp.where(ended > 0, gap, c.probe_gap),
        plain_segs=jnp.where(ended > 0, 0, c.plain_segs),
        seg_k=jnp.where(probe, 0, c.seg_k))
