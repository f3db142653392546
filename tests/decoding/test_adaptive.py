"""The adaptive controller: synthetic costs and acceptance, the ring statistics, and k changing
between steps without recompiles or any change of the output."""

import contextlib
import gc
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import DecodeConfig
from mtp_jax.decoding import adaptive as A
from mtp_jax.decoding import costs as costs_lib
from mtp_jax.decoding import engine as E
from mtp_jax.decoding import priors as priors_lib
from mtp_jax.decoding import ring as ring_lib
from mtp_jax.decoding import tables as T
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.serving import api
from tests.conftest import tiny_config
from tests.helpers import compiles


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


def test_a_few_good_trials_near_break_even_do_not_switch_to_drafting():
  """One draft costs 1.78 plain steps: it pays above ~0.8 acceptance. A window reading 0.85 over
  a probe's 16 trials (against an earlier runs' 0.72 of 16 pseudo-trials) is within its own
  error of break-even and keeps plain decoding; the same rate over 400 trials drafts."""
  cost = jnp.asarray([1.0, 1.78])
  conf, prior, active = jnp.full((16, 1), 0.5), jnp.asarray([0.72]), jnp.ones((16,), bool)
  for trials, want in ((16.0, 0), (400.0, 1)):
    alpha = A.estimate(jnp.asarray([0.85]), jnp.asarray([trials]), conf, prior,
                       jnp.asarray([16.0]))
    assert int(A.choose_k(cost, A.expected_emitted(alpha, active), 0.02)) == want, trials


def test_once_none_waits_the_slowest_row_sets_the_choice():
  """Tokens per second favour one draft (mean acceptance 0.7 against a cost of 1.5 plain
  steps); the end of the job is set by the row that drafts worst (0.4: 1.4 tokens a step), so
  plain decoding finishes sooner. A row that is done does not count."""
  cost = jnp.asarray([1.0, 1.5])
  alpha = jnp.asarray([[0.9], [0.8], [0.7], [0.4]])
  active, rem = jnp.ones((4,), bool), jnp.full((4,), 50)
  assert int(A.choose_k(cost, A.expected_emitted(alpha, active))) == 1
  assert int(A.choose_k_to_finish(cost, alpha, active, rem)) == 0
  assert int(A.choose_k_to_finish(cost, alpha, jnp.asarray([True, True, True, False]), rem)) == 1


def test_the_end_of_a_job_plans_with_the_slowest_of_many_rows():
  """64 rows alike (0.8 over 32 trials, 40 tokens left): the slowest of them realises about 2.4
  standard deviations less; one row alone plans with its estimate."""
  a = jnp.full((64, 2), 0.8)
  n = jnp.full((64, 2), 32.0)
  rem, act = jnp.full((64,), 40), jnp.ones((64,), bool)
  low = np.asarray(A.finish_alpha(a, n, rem, act))
  sd = np.sqrt(0.8 * 0.2 * (1 / 32 + 1.8 / 40))
  # The expected maximum of 64 standard normals is 2.41 (Blom's approximation: 2.34).
  assert np.all(low > 0.8 - 2.45 * sd) and np.all(low < 0.8 - 2.3 * sd), (low[0], sd)
  one = np.asarray(A.finish_alpha(a[:1], n[:1], rem[:1], act[:1]))
  np.testing.assert_allclose(one, 0.8, atol=1e-6)


def test_rows_scatter_sets_how_much_the_pool_counts_in_a_rows_estimate():
  """Rows alike: a row's estimate is the pool's (the pool's trials as pseudo-trials); one row
  far below the others (0.55 of 30 against 0.95): its estimate stays near its own counts."""
  act = jnp.ones((4,), bool)
  most = jnp.asarray([136.0])             # the pool's trials and the prior's
  alike = A.row_prior_trials(jnp.full((4, 1), 24.0), jnp.full((4, 1), 30.0), act, most)
  np.testing.assert_allclose(np.asarray(alike), [136.0])
  hits = jnp.asarray([[28.5], [28.5], [28.5], [16.5]])
  m = float(A.row_prior_trials(hits, jnp.full((4, 1), 30.0), act, most)[0])
  pool = float(jnp.sum(hits)) / 120
  own = (16.5 + m * pool) / (30 + m)
  assert 1.0 <= m < 10 and own < 0.65, (m, own)
  # A done row does not count.
  done = jnp.asarray([True, True, True, False])
  np.testing.assert_allclose(
      np.asarray(A.row_prior_trials(hits, jnp.full((4, 1), 30.0), done, jnp.asarray([106.0]))),
      [106.0])


def _probe_state(cost, prior):
  kd = len(prior)
  ctrl = A.init_controller(kd, cost, 4, 8).replace(prior_rate=jnp.asarray(prior, jnp.float32))
  record = type("R", (), {"ring": ring_lib.init_ring(8, 2, kd), "step": jnp.asarray(0)})
  rows = type("Rows", (), {"done": jnp.zeros((2,), bool)})
  return type("S", (), {"controller": ctrl, "record": record, "rows": rows})


def test_no_probe_where_even_an_optimistic_rate_cannot_pay():
  """16 slots on XLA:CPU: a draft costs 1.93 plain steps. With earlier runs' rates (0.7, 0.6,
  0.5) no k pays even a standard error above them: no probe. Unknown rates (a cold start) or a
  cheap draft (one slot): probes."""
  allowed = jnp.ones((4,), bool)
  wide, narrow = [1.0, 1.93, 2.55, 3.19], [1.0, 1.2, 1.4, 1.6]
  worth = lambda cost, prior: bool(A.worth_probing(_probe_state(cost, prior), allowed, 8, 0.02))
  assert not worth(wide, [0.7, 0.6, 0.5])
  assert worth(wide, [-1.0, -1.0, -1.0])
  assert worth(narrow, [0.7, 0.6, 0.5])


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


def test_window_rates_are_conditional_per_position():
  ring = ring_lib.init_ring(4, 2, 3)
  # Step 0: row 0 verified 3, accepted 1; row 1 verified 3, accepted 3.
  ring = ring_lib.record(ring, 0, jnp.zeros((2, 4), jnp.int32), jnp.array([2, 4]),
                         jnp.array([3, 3]), jnp.array([1, 3]), 3, 2)
  # Step 1: row 0 inactive; row 1 verified 2, accepted 0.
  ring = ring_lib.record(ring, 1, jnp.zeros((2, 4), jnp.int32), jnp.array([0, 1]),
                         jnp.array([0, 2]), jnp.array([0, 0]), 2, 1)
  rate, trials = A.window_rates(ring, jnp.asarray(2), 16, 3)
  # position 0: trials 3 (r0s0, r1s0, r1s1), hits 2; position 1: reached by r0s0 (acc>=1) and r1s0
  # -> trials 2, hits 1 (r1s0); position 2: reached by r1s0 only -> 1 trial, 1 hit.
  np.testing.assert_allclose(np.asarray(trials), [3, 2, 1])
  np.testing.assert_allclose(np.asarray(rate), [2 / 3, 1 / 2, 1.0])
  rate, trials = A.window_rates(ring, jnp.asarray(2), 1, 3)       # only the newest step
  np.testing.assert_allclose(np.asarray(trials), [1, 0, 0])


def test_cost_table_round_trip(tmp_path):
  path = str(tmp_path / "c.json")
  assert T.load_table(path, "x", 2) is None
  T.save_table(path, "x", {"cost_s": [1.0, 2.0]})
  T.save_table(path, "y", {"cost_s": [3.0]})
  assert T.load_table(path, "x", 2)["cost_s"] == [1.0, 2.0]
  assert T.load_table(path, "y", 1)["cost_s"] == [3.0]
  assert T.load_table(path, "y", 2) is None                     # another shape count


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
  dec.fix_costs([1.0, 1.01, 1.02, 1.03, 1.04])
  dec.warmup(16)
  # The first run after warm-up included: a batch job is one run.
  with _ks_run() as ks, compiles() as compiled:
    dec.run(reqs[:1])
    out = dec.run(reqs)
  assert compiled == [], compiled
  assert [c.token_ids for c in out] == [c.token_ids for c in plain]
  assert len(set(ks)) >= 2, f"k never changed: {sorted(set(ks))}"


@pytest.mark.slow
def test_probes_back_off_while_plain_decoding_wins_and_reset_once_drafting_pays(trained_tiny):
  """A probe ends a plain segment: its last two steps draft one head, and the last one checks
  the draft before it against the token it chose (real acceptance for the window, even where
  the controller began plain; a plain step, nothing more is committed). While probes lead to no
  drafting the gap
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
  # Drafting could pay only at acceptance near 1: probes are worth making (adaptive.worth_probing)
  # but the tiny heads' drafts never make the controller draft.
  state = _controller(state, cost=jnp.asarray([1.0 + 0.9 * k for k in range(eng.kd + 1)]))
  drafting, verifying = [], []
  for step in range(42):
    draft = int(state.drafts.tokens[0, 0])
    state = eng.generate(params, state, 1)
    if int(state.drafts.n_fresh[0]) > 0:
      drafting.append(step)
    assert int(state.record.ring.k_used[step % 16]) == 0
    assert int(state.record.ring.emitted[step % 16, 0]) == 1
    if int(state.record.ring.verified[step % 16, 0]) > 0:
      verifying.append(step)   # accepted where plain decoding chose the draft
      chose = int(state.record.ring.tokens[step % 16, 0, 0])
      assert int(state.record.ring.accepted[step % 16, 0]) == (chose == draft)
  # Segments of 3 steps; probes after 2, then 4, then 4 (the cap) plain segments, each
  # drafting at its last two steps; a plain step checks the fresh draft it holds: the probe's
  # second-to-last step's (at its last) and its last step's (the next), but not the prefill's
  # (step 0: a row's first step checks nothing).
  probes = [5, 17, 29, 41]
  assert verifying == [5, 6, 17, 18, 29, 30, 41], verifying
  assert drafting == [s + d for s in probes for d in (-1, 0)], drafting
  assert int(state.controller.probe_gap) == 4
  # A call through the next probe (steps 51-53): plain up to it, the probe segment, then plain
  # decoding again in the same call, to the call's 15 steps.
  state = eng.generate(params, state, 15)
  assert int(state.record.step) == 57 and int(state.drafts.n_fresh[0]) == 0
  assert int(state.controller.plain_segs) == 1
  verified = np.asarray(state.record.ring.verified[:, 0])
  assert verified[np.arange(42, 57) % 16].tolist() == [1] + [0] * 10 + [1, 1] + [0] * 2
  # Drafting made to pay even at the tiny heads' low acceptance: the next segment drafts, and
  # the gap is the acceptance window's 6 steps (2 segments): probes before that would see the
  # same rates.
  state = _controller(state, cost=jnp.asarray([1.0] + [0.9] * eng.kd))
  state = eng.generate(params, state, 6)
  assert int(np.asarray(state.record.ring.k_used)[np.arange(57, 63) % 16].max()) > 0
  assert int(state.controller.probe_gap) == 2


@pytest.mark.slow
def test_a_probe_that_leads_to_drafting_goes_on_drafting_in_its_call(trained_tiny):
  """Drafting segments run in the drafting loops: where the probe loop would begin one, the
  call's next round of loops runs it, in the same call."""
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
  # Equal costs and a prior of sure drafts: the controller stays plain without fresh drafts, and
  # drafts all heads once the probe (two plain steps drafting one head, the second checking the
  # first's draft) brings a fresh draft; the call runs its 16 steps: the probe segment, then 14
  # steps of all heads.
  state = eng.generate(params, _controller(state, k_force=jnp.asarray(-1, jnp.int32),
                                           prior_rate=jnp.full((kd,), 0.99)), 16)
  assert int(state.record.step) == 20
  k_used = np.asarray(state.record.ring.k_used)
  assert k_used[4:6].tolist() == [0, 0]
  assert np.asarray(state.record.ring.verified)[4:6, 0].tolist() == [0, 1]
  assert k_used[np.arange(6, 20) % 16].tolist() == [kd] * 14


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
      hlo = eng._generate.lower(params, eng.unembed(params), state, jnp.asarray(8, jnp.int32),
                                jnp.asarray(0, jnp.int32), jnp.asarray(0.0), jnp.asarray(False),
                                sample=sample, ks=eng.ks).compile().as_text()
      copies = re.findall(rf"= f32\[{b},{s},{g},{h}\]\S* copy\(", hlo)
      assert hlo.count("while(") >= (2 * eng.kd + 2 if adaptive else 1)
      assert not copies, (adaptive, sample, copies[:3])


@pytest.mark.slow
def test_shapes_are_compiled_as_the_controller_wants_them(trained_tiny):
  """A learning decoder compiles plain decoding and the chains the prior leaves viable; a shape
  the controller wants often enough (costs.OPEN_AFTER segments and OPEN_SHARE of its choices,
  once the costs are learned) is opened. A program not compiled yet compiles on a thread while
  the call runs one that is (or the largest opened shape alone): the output stays that of plain
  greedy decoding whatever runs, and a program of fewer shapes holds fewer loops."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  prompts = [tok.encode(t) for t in ("def f(x):\n", "import os\n\nclass A:\n", "    return x")]
  reqs = [api.Request(p, n) for p, n in zip(prompts, [30, 12, 40])]
  plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=0))
  want = [c.token_ids for c in plain.run(reqs)]

  def loops(eng):
    hlo = eng._generate.lower(params, eng.unembed(params), eng.init_state(),
                              jnp.asarray(8, jnp.int32),
                              jnp.asarray(0, jnp.int32), jnp.asarray(0.0), jnp.asarray(False),
                              sample=False, ks=eng.ks).compile().as_text()
    return hlo.count("while(")

  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, adaptive=True, ring_size=8,
                                                          adapt_margin=0.0))
  eng, kd = dec.engine, dec.engine.kd
  dec.warmup(16)
  learner = dec.learner
  start = set(costs_lib.viable_chains(eng)) | {costs_lib.first_shape(eng)}
  assert eng.ks == tuple(sorted(start | {0})) and (False, eng.ks) in eng.programs.ready
  for _ in range(2):
    assert [c.token_ids for c in dec.run(reqs)] == want
  often = ((learner.wanted >= costs_lib.OPEN_AFTER)
           & (learner.wanted >= costs_lib.OPEN_SHARE * learner.wanted.sum()))
  assert {s for s in range(1, kd + 1) if often[s]} <= set(eng.ks)
  assert learner.model.calls > costs_lib.LEARN_FIRST
  # Fewer shapes: the opened chain runs alone until its program is compiled, the same tokens.
  eng.opened = {1}
  assert [c.token_ids for c in dec.run(reqs)] == want
  assert (False, (1,)) in eng.programs.ready           # ran while (0, 1) compiled
  eng.programs.wait()
  assert (False, (0, 1)) in eng.programs.ready
  assert [c.token_ids for c in dec.run(reqs)] == want
  small = loops(eng)
  eng.opened = set(range(1, kd + 1))
  assert small < loops(eng)


def test_a_run_that_can_never_leave_plain_decoding_runs_on_the_plain_engine(trained_tiny):
  """Where even the prior's most optimistic rates (one standard error above, with one row
  active: the widest error a run can reach) make no draft pay, no step of the run could draft or
  probe: it runs on the decoder's plain engine, with plain decoding's tokens. A cold start (an
  unknown prior counts on 1.0 at the first position) or a prior that could pay keeps the
  adaptive loop."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  prompts = [tok.encode(t) for t in ("def f(x):\n", "import os\n\nclass A:\n", "    return x")]
  reqs = [api.Request(p, n) for p, n in zip(prompts, [30, 12, 40])]
  want = [c.token_ids for c in
          api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=0)).run(reqs)]
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, adaptive=True, ring_size=8))
  kd = dec.engine.kd
  dec.fix_costs([1.0] + [1.5 + 0.5 * i for i in range(kd)])
  low, high, m = [0.2] * kd, [0.95] * kd, [50.0] * kd
  assert not dec.engine.stays_plain()
  assert dec.engine.stays_plain(low, m) and not dec.engine.stays_plain(high, m)
  calls = {"adaptive": 0, "plain": 0}
  for name, eng in (("adaptive", dec.engine), ("plain", dec.plain)):
    def counted(*a, _g=eng.generate, _n=name, **kw):
      calls[_n] += 1
      return _g(*a, **kw)
    eng.generate = counted
  for prior, used in ((low, "plain"), (high, "adaptive")):
    dec.priors.start = lambda sampled, prior=prior: (prior, m)
    calls.update(adaptive=0, plain=0)
    assert [c.token_ids for c in dec.run(reqs)] == want
    assert calls[used] > 0 and sum(calls.values()) == calls[used], (prior, calls)
  dec.priors.start = lambda sampled: (low, m)
  dec.run(reqs)
  assert dec.last_stats["drafted"] == [0] * kd


def test_rates_of_a_run_become_the_next_runs_prior():
  # 100 first drafts verified, 80 accepted; 80 second drafts reached, 60 accepted (conditional
  # 0.75); 60 third drafts reached, 30 accepted (0.5); a position with too few trials is unknown.
  assert T.run_rates([100, 80, 60], [80, 60, 30]) == [0.8, 0.75, 0.5]
  assert T.run_rates([100, 10], [80, 5]) == [0.8, -1.0]
  conf = jnp.full((2, 3), 0.3)
  no_trials, m = jnp.zeros((3,)), jnp.full((3,), 16.0)
  alpha = A.estimate(jnp.zeros((3,)), no_trials, conf, jnp.asarray([0.9, 0.8, -1.0]), m)
  # Known positions take the prior as it is, an unknown one the estimate before it: with no
  # trial in the window, no sampling error to guard against.
  np.testing.assert_allclose(np.asarray(alpha), [[0.9, 0.8, 0.8]] * 2, atol=1e-6)
  # A known prior outweighs the head's confidence, however sure the head.
  sure = jnp.asarray([[0.95, 0.3, 0.3], [0.3] * 3])
  alpha = A.estimate(jnp.zeros((3,)), no_trials, sure, jnp.asarray([0.9, 0.8, -1.0]), m)
  np.testing.assert_allclose(np.asarray(alpha)[:, 0], [0.9, 0.9], atol=1e-6)
  # Without a prior, the heads' confidence.
  alpha = A.estimate(jnp.zeros((3,)), no_trials, conf, jnp.full((3,), -1.0), m)
  np.testing.assert_allclose(np.asarray(alpha), np.full((2, 3), 0.3), atol=1e-6)
  # The window's counts outweigh the prior as they grow against its pseudo-trials, less the
  # window's weight times its standard error.
  for m_prior in (16.0, 144.0):
    alpha = A.estimate(jnp.asarray([0.5, 0.5, 0.5]), jnp.asarray([48.0, 48.0, 0.0]), conf,
                       jnp.asarray([0.9, 0.9, 0.9]), jnp.full((3,), m_prior))
    lam = 48 / (48 + m_prior)
    blend = lam * 0.5 + (1 - lam) * 0.9
    se_w = lam * np.sqrt(blend * (1 - blend) / 48)
    np.testing.assert_allclose(np.asarray(alpha)[0], [blend - se_w, blend - se_w, 0.9],
                               atol=1e-6)


def test_a_prior_alone_is_not_discounted_as_a_sample():
  """One slot after a plain stretch: the window holds no trials, and earlier runs measured
  0.77 / 0.79 / 0.86 (2.9 tokens a step with 3 drafts, at 2.43 plain steps' cost: 1.2x). Taken
  one standard error below over 16 pseudo-trials each (2.5 tokens), that would look no better
  than plain decoding, and a one-slot stream would decode plainly until a probe's few checks
  outweighed it; as a measured rate it drafts 3."""
  cost = jnp.asarray([1.0, 1.75, 2.27, 2.43])
  prior, conf, active = jnp.asarray([0.77, 0.79, 0.86]), jnp.full((1, 3), 0.5), jnp.ones((1,), bool)
  alpha = A.estimate(jnp.zeros((3,)), jnp.zeros((3,)), conf, prior, jnp.full((3,), 16.0))
  assert int(A.choose_k(cost, A.expected_emitted(alpha, active), 0.06)) == 3
  as_sample = prior - np.sqrt(prior * (1 - prior) / 16.0)
  assert int(A.choose_k(cost, A.expected_emitted(as_sample[None], active), 0.06)) == 0


def test_the_prior_pools_the_counts_of_the_decoders_requests(tmp_path):
  """The next run's prior is the acceptance of all the decoder's requests so far, pooled by
  their trials: one hard request (at one slot a run may hold only it) does not set every later
  run's prior. One request's rate counts as a guess does (one window, here 16 trials; at most
  its own trials). It is stored after the first run, and again once the decoder is collected."""
  path = str(tmp_path / "tables.json")
  pri = priors_lib.Priors(4, window=16)
  pri.path, pri.keys = path, {False: "greedy", True: "sampled"}      # as calibrate sets them
  assert pri.start(False) == (None, None)
  easy = ([100, 90, 80, 70], [90, 80, 70, 60])
  hard = ([40, 16, 4, 0], [16, 4, 0, 0])             # later positions unknown
  pri.learn(False, [easy[0]], [easy[1]])
  rates, m = pri.start(False)
  assert rates == T.run_rates(*easy) and m == [16.0] * 4     # one request: one window
  pri.learn(False, [hard[0]], [hard[1]])
  pooled = [106 / 140, 84 / 106, 70 / 84, 60 / 70]
  np.testing.assert_allclose(pri.start(False)[0], pooled)
  assert pri.start(True) == (None, None)                              # sampled runs apart
  assert T.load_rates(path, "greedy") == (pytest.approx(T.run_rates(*easy), abs=1e-4),
                                          [16.0] * 4)
  few = priors_lib.Priors(2, window=32)
  few.learn(False, [[20, 0]], [[18, 0]])
  assert few.start(False)[1] == [20.0, 1.0]          # no more than the request's own trials
  stored = pri.start(False)
  del pri
  gc.collect()
  got = T.load_rates(path, "greedy")
  assert got[0] == pytest.approx(stored[0], abs=1e-4) and got[1] == pytest.approx(stored[1], 0.01)


def test_the_priors_weight_follows_how_far_requests_scatter():
  """Requests that accept alike (each 0.8 of 100 first drafts): the pool counts for as many
  trials as a scatter within its own error allows. Requests far apart (0.95 and 0.55): for a
  few, so that the window's 16 trials of the request at hand (0.55) soon outweigh it, where the
  alike pool would hold the estimate near its own rate. The weight is the beta-binomial
  moments' (tau^2 = p (1 - p) / (m + 1))."""
  def weight(hits):
    c = priors_lib.Counts(1, alone=16.0)
    c.add([[100.0]] * len(hits), [[h] for h in hits])
    return c.prior()[1][0]
  # No scatter beyond the noise: tau^2 at its standard error, noise sqrt(2 / J) (0.16 / 100
  # x 0.447 for 10 requests): ~223 pseudo-trials, not every trial of the pool.
  alike = weight([80.0] * 10)
  assert alike == pytest.approx(0.16 / (0.16 / 100 * np.sqrt(2 / 10)) - 1, rel=1e-6)
  assert 200 < alike < 1000
  m = weight([95.0, 55.0] * 5)
  p, scatter = 0.75, 0.2 ** 2
  assert m == pytest.approx(p * (1 - p) / (scatter - p * (1 - p) / 100) - 1, rel=1e-6)
  assert 1.0 <= m < 6.0
  conf = jnp.full((1, 1), 0.5)
  at = lambda m_: float(A.estimate(jnp.asarray([0.55]), jnp.asarray([16.0]), conf,
                                   jnp.asarray([0.75]), jnp.asarray([m_]))[0, 0])
  assert at(m) < 0.55 < 0.7 < at(alike)


@pytest.mark.slow
def test_a_later_process_starts_from_the_acceptance_a_run_stored(trained_tiny, tmp_path):
  """Beside the cost table, a run stores the acceptance per position it measured, keyed by the
  weights, greedy and sampled apart; a new decoder of the same model starts from the first
  position's rate (later positions are left to its own trials); other weights do not find it."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  dcfg = DecodeConfig(batch_size=2, max_len=96, adaptive=True, ring_size=8)
  path = str(tmp_path / "tables.json")
  reqs = [api.Request(tok.encode(p), 64) for p in ("def f(x):\n    return x", "import os\n")]

  def decoder(p=params):
    dec = api.Decoder(mcfg, hcfg, p, tok, dcfg)
    # Drafting all but free: the controller drafts, and the run has counts to store.
    T.save_table(path, T.table_key(dec.engine),
                 {"cost_s": [1.0 + 0.01 * k for k in range(dec.engine.kd + 1)],
                  "rel_sd": [0.0] * (dec.engine.kd + 1)})
    dec.cost_table(path)
    starts = []
    generate = dec.engine.generate

    def spy(params_, state, *a, **kw):
      if not starts:
        ctrl = state.controller
        starts.append(np.asarray(ctrl.prior_rate))
        starts.append(np.asarray(ctrl.prior_trials))
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
  stored, weights = stored
  assert stored[0] >= 0 and weights[0] >= 1.0
  assert stored == pytest.approx(T.run_rates(st["cond_trials"], st["cond_hits"]), abs=1e-4)
  assert T.load_rates(path, T.rates_key(dec.engine, T.params_fingerprint(params), True)) is None

  dec2, starts2 = decoder()
  dec2.run(reqs)
  np.testing.assert_allclose(starts2[0], [stored[0]] + [-1.0] * (dec2.engine.kd - 1),
                             atol=1e-6)
  # Its weight as stored; a guess (unknown rate) counts for one window.
  window = dcfg.accept_window
  np.testing.assert_allclose(starts2[1], [weights[0]] + [window] * (dec2.engine.kd - 1),
                             atol=0.05)

  other = jax.tree.map(lambda x: x * 1.01 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                       params)
  assert T.params_fingerprint(other) != T.params_fingerprint(params)
  dec3, starts3 = decoder(other)
  dec3.run(reqs)
  assert np.all(starts3[0] == -1.0)
