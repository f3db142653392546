"""The loops of one `generate` call: steps in `lax.while_loop`s on the device, state carried.

A fixed-k engine runs one loop of its step. Adaptive k runs segments of adapt_every steps whose
shape the controller chooses where each begins (segments run across calls: the step count tells
where one is). A drafting step drafts its own k and the first draft's confidence (what the
controller reads); where the controller raises k, the first step of the larger k verifies the
drafts there are (n_fresh), and the controller estimates the positions past a row's fresh
drafts from the rates and the prior (controller_limit). A plain segment drafts nothing, except
a probe: its last two steps draft one head each, and a plain step holding a fresh draft checks
it against the token it chose (step._shadow_check: what a step of one draft would have
accepted, nothing committed), so that the window sees real acceptance and fresh confidences
when acceptance may have recovered, at the cost of the heads' work alone. (Confidences alone
keep a controller that began plain there: the heads' peak probability understates how often
their drafts are accepted, and nothing else would ever be verified.) A probe comes every
probe_gap plain segments, and only where it could lead to drafting: some k beats plain decoding
at the rates one standard error above their estimates (adaptive.worth_probing; once it says no,
none until the call's end); the gap doubles after each probe (up to probe_every_max) and is
accept_window steps (in segments) after a drafting segment: the turn to plain decoding is
checked again once the rates that made it have left the window.

An adaptive call runs rounds of loops, each loop one shape's step: the drafting shapes of ks
(chains k > 0, then adaptive k's trees), the largest index first; plain steps; a probe's two
drafting steps. Each runs while the segment's shape is its own; where a step ends a segment,
`next_segment` (behind a lax.cond) keeps the bookkeeping and sets the next segment's shape and
whether it probes. Where that hands over to a loop already passed, the next round runs it; the
call ends after num_steps steps, where no row goes on, or after a round that ran no step. Why
loops: a lax.switch over shapes gives each branch a copy of every buffer it updates (the whole
KV cache, every step); a while_loop updates its carry in place. The controller is asked only
where its answer can change what runs: choose_k where some row holds a fresh draft (without one
plain decoding is the cheapest shape), worth_probing where a probe is due. XLA:CPU's cost per
call grows with the program's size, loops not run included (an empty call of the demo's
adaptive program: ~120 us a step variant), so each step variant is compiled once. A run that
could never leave plain decoding (stays_plain) runs on a plain engine instead (api.Decoder.run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtp_jax.decoding import adaptive
from mtp_jax.decoding import step as step_lib
from mtp_jax.decoding.state import DecodeState


def _set_controller(state: DecodeState, **values) -> DecodeState:
  return state.replace(controller=state.controller.replace(**values))


def _lazily(ask, evaluate, default=False):
  """evaluate() where ask, else default: the controller's evaluations (choose_k, worth_probing)
  cost ~100 us a pair on XLA:CPU at 4 slots, about an eighth of a plain step, and a call inside
  a plain run needs none."""
  return jax.lax.cond(ask, evaluate, lambda: jax.tree.map(jnp.asarray, default))


def controller_limit(eng, state: DecodeState):
  """Per row, the drafts the controller may expect it to verify: none without a fresh draft
  (a plain step drafts nothing), the threshold's cut where it falls within the fresh drafts,
  else all Kd: a probe drafts only the first head, and the positions past it are estimated
  from the ring's rates and the prior (adaptive.estimate), as for any position that has no
  draft yet."""
  lim = step_lib.row_limit(eng.step_cfg, state.drafts)
  fresh = state.drafts.n_fresh
  return jnp.where((fresh > 0) & (lim >= fresh), eng.kd, lim).astype(jnp.int32)


def room(eng, state: DecodeState):
  """-> [n_shapes] bool: the shapes the segment that begins at state may run, were they all
  compiled: a chain always (every row keeps Kd+1 positions free); a tree of T nodes only where
  the longest active row, grown by Kd+1 tokens in each of the segment's other steps, still has T
  positions past its last token (rows keep no room for adaptive k's trees, so a long context
  keeps every position a chain can use)."""
  n, kd = eng.n_shapes, eng.kd
  size = np.asarray([eng.shape(i).size for i in range(n)])
  longest = jnp.max(jnp.where(state.rows.done, 0, state.rows.length))
  reach = longest + (eng.cfg.adapt_every - 1) * (kd + 1)
  return (jnp.arange(n) <= kd) | (reach + size <= eng.cfg.max_len)


def allowed(eng, state: DecodeState, ks: tuple[int, ...]):
  """-> [n_shapes] bool: the shapes of ks (those compiled) that `room` leaves."""
  return jnp.isin(jnp.arange(eng.n_shapes), jnp.asarray(ks)) & room(eng, state)


def choose_k(eng, state: DecodeState, ks: tuple[int, ...], closed):
  """The controller's shape index for the segment, on the device (adaptive.choose), one of ks
  that `allowed` leaves, and the one it would choose among every shape with room (what the host
  compiles next where ks lacks it). closed: no request will take a slot. -> (index, wanted)."""
  return adaptive.choose(state, controller_limit(eng, state), allowed(eng, state, ks),
                         eng.cfg.accept_window, eng.cfg.adapt_margin, eng.shape_set, closed,
                         room(eng, state))


def worth_probing(eng, state: DecodeState):
  """Whether a probe could lead the controller to draft (adaptive.worth_probing), in any shape
  (one not compiled yet is, once the controller wants it)."""
  return adaptive.worth_probing(state, jnp.ones((eng.n_shapes,), bool), eng.cfg.accept_window,
                                eng.cfg.adapt_margin, eng.shape_set)


def stays_plain(eng, cost, prior, prior_trials):
  """-> [] bool: whether a run whose controller starts from this prior can never leave plain
  decoding: no probe would be worth making even with one row active (the prior's widest error,
  adaptive.prior_weight) and the window empty, as it stays in a run that neither drafts nor
  probes. The controller's choices count on rates no higher than those a probe's test tries,
  so such a run decodes plainly throughout, and a plain engine can run it (api.Decoder.run)."""
  c = adaptive.init_controller(eng.kd, cost, eng.cfg.probe_every, eng.cfg.accept_window, prior,
                               prior_trials)
  allowed_S = jnp.ones((eng.n_shapes,), bool)
  zero_K = jnp.zeros((eng.kd,), jnp.float32)
  m_K = adaptive.prior_weight(c, jnp.ones((1,), bool))
  return ~adaptive.optimistic_pays(c, zero_K, zero_K, m_K, allowed_S, eng.cfg.adapt_margin,
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
    """Rounds of loops, one per step variant: (shape k, drafts made nd, while what holds). A
    program of one shape runs it alone, with no controller (programs.py: while the engine's
    program compiles)."""
    if len(self.ks) == 1:
      k = self.ks[0]
      return self.fixed(state, k, self.eng.depth(k) if k else 0)
    every = self.every
    late = lambda st: st.record.step % every >= every - 2      # a probe's drafting steps
    loops = [(k, self.eng.depth(k), lambda s, k=k: s.kc == k) for k in sorted(self.ks[1:])[::-1]]
    loops += [(0, 0, lambda s: (s.kc == 0) & ~(s.probe & late(s.st))),
              (0, 1, lambda s: (s.kc == 0) & s.probe & late(s.st))]

    def round_(c):
      """Each loop once, in order; each runs while its condition holds."""
      i0 = c.i
      for k, nd, keeps in loops:
        c = jax.lax.while_loop(lambda c, keeps=keeps: keeps(c) & self.call_goes_on(c),
                               lambda c, k=k, nd=nd: self.segment_step(c, k, nd), c)
      return c.replace(ran=c.i > i0)

    # Rounds while the call goes on: where a loop hands over to one passed already, the next
    # round runs it. A round that ran no step ends the call.
    c = jax.lax.while_loop(lambda c: c.ran & self.call_goes_on(c), round_, self.start(state))
    return c.st

  def call_goes_on(self, c) -> jax.Array:
    return (c.i < self.num_steps) & self.goes_on(c.st)

  def start(self, st: DecodeState) -> "_Carry":
    """The call's carry: the shape of the segment st's step begins or continues (a call that
    begins inside a drafting segment continues it; inside a plain segment it chooses again:
    rows inserted since bring fresh drafts), and whether that segment probes."""
    c = st.controller
    ok_S = allowed(self.eng, st, self.ks)
    cont = ((st.record.step % self.every > 0) & (c.seg_k > 0) & (c.k_force < 0) & ok_S[c.seg_k])
    ask = self.fresh(st) | (c.k_force >= 0)
    chosen, st = self.ask(~cont & ask, st)
    kc = jnp.where(cont, c.seg_k, chosen)
    probe, hopeless = self.probes(st, kc, jnp.asarray(False))
    return _Carry(i=self.zero, kc=kc, probe=probe, hopeless=hopeless,
                  st=_set_controller(st, seg_k=kc), ran=jnp.asarray(True))

  def ask(self, ask, st: DecodeState):
    """The controller's shape where `ask` (else plain decoding), its wish among every shape
    counted in the controller (Controller.wanted). -> (shape index, st)."""
    k, want = _lazily(ask, lambda: choose_k(self.eng, st, self.ks, self.closed),
                      (self.zero, self.zero))
    c = st.controller
    return k, _set_controller(st, wanted=c.wanted.at[want].add(ask.astype(jnp.int32)))

  def fresh(self, st: DecodeState) -> jax.Array:
    """Whether the controller could choose k > 0: some active row holds a fresh draft, or the
    cost table has a shape cheaper than a plain step (by the margin). Without a fresh draft
    every shape expects one token a row, so plain decoding is then the cheapest."""
    c = st.controller
    cheaper = jnp.any(c.cost[1:] * (1.0 + self.eng.cfg.adapt_margin) < c.cost[0])
    return jnp.any(~st.rows.done & (st.drafts.n_fresh > 0)) | cheaper

  def probes(self, st: DecodeState, kc, hopeless):
    """Whether the plain segment st begins probes: one is due (probe_gap plain segments since
    the last probe or drafting segment), k is not forced, and it could lead to drafting
    (worth_probing, asked only where due; once it says no, plain decoding runs to the end of
    the call, hopeless). -> (probe, hopeless)."""
    c = st.controller
    due = (kc == 0) & (c.plain_segs + 1 >= c.probe_gap) & (c.k_force < 0) & ~hopeless
    worth = _lazily(due, lambda: worth_probing(self.eng, st))
    return due & worth, hopeless | (due & ~worth)

  def segment_step(self, c: "_Carry", k: int, nd: int) -> "_Carry":
    """One step of shape k (nd drafts made: the shape's depth when drafting, one in a probe's
    last two steps, else none); where it ends a segment, the next segment's shape and whether it
    probes (next_segment)."""
    st = self.eng.step(self.m, c.st, k, self.sample, nd, dm=self.dm, want_conf=k > 0 or nd > 0,
                       ranked=self.ranked)
    c = c.replace(i=c.i + 1, st=st)
    ends = st.record.step % self.every == 0
    ctrl = st.controller
    kc, probe, hopeless, gap, segs, wanted = jax.lax.cond(
        ends, lambda: self.next_segment(c, k),
        lambda: (c.kc, c.probe, c.hopeless, ctrl.probe_gap, ctrl.plain_segs, ctrl.wanted))
    st = _set_controller(st, probe_gap=gap, plain_segs=segs, seg_k=kc, wanted=wanted)
    return c.replace(kc=kc, probe=probe, hopeless=hopeless, st=st)

  def next_segment(self, c: "_Carry", k: int):
    """At a segment's end, after a segment of k drafts: its bookkeeping (after a drafting
    segment the next probe comes once the rates that made it have left the window; after a
    probe the gap doubles, up to probe_every_max; a plain segment counts), then the next
    segment's shape (the controller asked where it could choose k > 0) and whether it probes.
    -> (kc, probe, hopeless, probe_gap, plain_segs, wanted)."""
    cfg, st = self.eng.cfg, c.st
    ctrl = st.controller
    if k > 0:
      gap = jnp.asarray(min(-(-cfg.accept_window // self.every), cfg.probe_every_max), jnp.int32)
      segs = self.zero
    else:
      gap = jnp.where(c.probe, jnp.minimum(2 * ctrl.probe_gap, cfg.probe_every_max),
                      ctrl.probe_gap)
      segs = jnp.where(c.probe, 0, ctrl.plain_segs + 1)
    st = _set_controller(st, probe_gap=gap, plain_segs=segs)
    # A forced k keeps its shape (a drafting one is checked against the rows' room).
    ask = (self.fresh(st) & (ctrl.k_force < 0)) | (k > 0)
    kc, st = self.ask(ask, st)
    probe, hopeless = self.probes(st, kc, c.hopeless)
    return kc, probe, hopeless, gap, segs, st.controller.wanted


@struct.dataclass
class _Carry:
  """The adaptive loops' carry."""
  i: jax.Array             # [] steps run in this call
  kc: jax.Array            # [] the shape index of the current segment
  probe: jax.Array         # [] bool: the current (plain) segment probes
  hopeless: jax.Array      # [] bool: worth_probing said no in this call (no probe until its end)
  st: DecodeState
  ran: jax.Array           # [] bool: the last round ran a step
