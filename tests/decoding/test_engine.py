"""The speculative engine: exact greedy output, lossless sampling, no recompiles, the ring."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import DecodeConfig
from mtp_jax.decoding import engine as E
from mtp_jax.decoding import ring as ring_lib
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.serving import api
from mtp_jax.training import generate as G
from tests.helpers import (
  assert_same_distribution,
  compiles,
  heldout_prompts,
  sample_engine,
  second_and_third,
)


@pytest.fixture(scope="module")
def tiny_model(trained_tiny):
  cfg, workdir, _ = trained_tiny
  return ckpt_lib.load_model_dir(os.path.join(workdir, "model")), cfg


@pytest.mark.parametrize("k, threshold", [(1, 0.0), (2, 0.0), (4, 0.0), (4, "median")])
def test_greedy_speculative_equals_plain_greedy(tiny_model, k, threshold):
  (mcfg, hcfg, params, tok), cfg = tiny_model
  prompts = heldout_prompts(cfg, tok, 7)
  if threshold == "median":
    # A confidence threshold that cuts about half of the chains of these prompts.
    eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=1, k=k), tok.eod_id)
    confs = [np.asarray(eng.prefill(params, [p], jax.random.key(0), [0.0], [0], [1.0])
                        .draft_conf)[0, 1] for p in prompts]
    threshold = float(np.median(confs))
  max_new = [5, 40, 17, 33, 1, 26, 40]
  reqs = [api.Request(p, m) for p, m in zip(prompts, max_new)]
  plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=3, k=0, ring_size=8))
  spec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=3, k=k, ring_size=8,
                                                          confidence_threshold=threshold))
  a, b = plain.run(reqs), spec.run(reqs)
  for ra, rb in zip(a, b):
    assert ra.token_ids == rb.token_ids and ra.finish_reason == rb.finish_reason
  st = spec.last_stats
  assert sum(st["accepted"]) > 0, "no draft was ever accepted: the test would prove nothing"
  assert any(r.acceptance_length > 1 for r in b)
  # The run's counts are every request's (7 through 3 slots), not the last one's in each slot.
  assert st["row_steps"] == sum(r.steps for r in b)
  assert st["acceptance_length"] == pytest.approx(
      sum(r.acceptance_length * r.steps for r in b) / st["row_steps"])
  # And both equal the independent reference implementation of greedy decoding.
  graphdef, _ = (spec.engine.graphdef, None)
  for p, m, r in zip(prompts, max_new, a):
    ref = np.asarray(G.greedy_generate(graphdef, params, jnp.asarray([p], jnp.int32),
                                       jnp.asarray([len(p)], jnp.int32), m))[0, len(p):].tolist()
    if tok.eod_id in ref:
      ref = ref[: ref.index(tok.eod_id)]
    assert r.token_ids == ref


def test_greedy_with_repetition_penalty_equals_the_reference(tiny_model):
  """Greedy rows with a repetition penalty go through the sampling variant as one-hot
  distributions; they must still equal plain decoding and a direct reference loop."""
  (mcfg, hcfg, params, tok), cfg = tiny_model
  prompts = heldout_prompts(cfg, tok, 3, seed=11)
  reqs = [api.Request(p, 24, 0.0, 0, 1.0, 1.8) for p in prompts]
  plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=0, ring_size=8))
  spec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=3, ring_size=8))
  a, b = plain.run(reqs), spec.run(reqs)
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  from mtp_jax.decoding import sampling as S
  from mtp_jax.models import model as M
  width = max(len(p) for p in prompts) + 24

  @jax.jit
  def next_token(seq_1W, n):
    """The full forward pass without a cache over the first n tokens (one compiled shape: a
    causal model's position n-1 does not see the padding after it), penalised, argmax."""
    m = M.bind(spec.engine.graphdef, params)
    h, _ = m(seq_1W, jnp.arange(width)[None])
    known = jnp.arange(width) < n
    pres = jnp.zeros((1, mcfg.vocab_size), bool).at[0, seq_1W[0]].max(known)
    logits = S.penalize(m.logits(h[:, n - 1]), jnp.array([1.8]), pres)
    return jnp.argmax(logits[0])

  for p, r in zip(prompts, a):
    seq = np.zeros((1, width), np.int32)
    seq[0, :len(p)] = p
    for n in range(len(p), len(p) + len(r.token_ids)):
      seq[0, n] = int(next_token(jnp.asarray(seq), n))
    assert seq[0, len(p):len(p) + len(r.token_ids)].tolist() == r.token_ids
  no_penalty = plain.run([api.Request(p, 24) for p in prompts])
  assert [r.token_ids for r in no_penalty] != [r.token_ids for r in a]


def test_rows_stop_when_the_cache_is_full(tiny_model):
  (mcfg, hcfg, params, tok), cfg = tiny_model
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=2, max_len=48))
  out = dec.run([api.Request([7] * 20, 500)])[0]
  assert out.finish_reason in ("length", "stop")
  if out.finish_reason == "length":
    assert 20 + len(out.token_ids) == 48 - 2 - 1


@pytest.mark.parametrize("penalty, threshold, adaptive",
                         [(1.0, 0.0, False), (3.0, 0.0, False), (1.0, "median", False),
                          (1.0, 0.0, True)])
def test_sampling_is_lossless(tiny_model, penalty, threshold, adaptive):
  """The 2nd and 3rd generated tokens (produced by draft-and-verify steps, the 1st comes from
  prefill) follow the same distribution with k = 3 (fixed, or chosen by the adaptive loop up to
  3) as with plain sampling. Two-sample chi-square
  test of homogeneity on the joint (2nd, 3rd) pairs, categories with fewer than 20 samples in
  all pooled; the test fails below p = 1e-4 (a correct engine fails once in 10,000 runs)."""
  (mcfg, hcfg, params, tok), cfg = tiny_model
  prompt = heldout_prompts(cfg, tok, 1, seed=3)[0][:12]
  if threshold == "median":      # cut about half of the chains at their first draft
    eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=64, k=3), tok.eod_id)
    pre = eng.prefill(params, [prompt] * 64, jax.random.key(9), [1.0] * 64, [4] * 64, [1.0] * 64)
    threshold = float(np.median(np.asarray(pre.draft_conf)[:, 0]))
  plain, _ = sample_engine(mcfg, hcfg, params, tok, 0, 24, 64, prompt, 3, seed=1,
                           penalty=penalty)
  spec, st = sample_engine(mcfg, hcfg, params, tok, 3, 24, 64, prompt, 3, seed=2,
                           penalty=penalty, threshold=threshold, adaptive=adaptive)
  assert sum(st["accepted"]) > 0.1 * sum(st["drafted"]), st
  if threshold:
    assert sum(st["drafted"]) < 0.9 * 3 * 24 * 64 * 2, "the threshold cut no chain"
  assert_same_distribution(second_and_third(plain), second_and_third(spec))


def test_no_recompilation_after_warmup(tiny_model):
  (mcfg, hcfg, params, tok), cfg = tiny_model
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=3, ring_size=8))
  prompts = heldout_prompts(cfg, tok, 9, seed=5)
  assert dec.warmup(max_prompt_len=40) == 3             # buckets 16, 32, 64
  with compiles() as compiled:
    dec.run([api.Request(prompts[2][:12], 20), api.Request(prompts[3][:9], 3)])
    dec.run([api.Request(prompts[4][:28], 11, 1.0, 0, 1.0),
             api.Request(prompts[5][:7], 30, 0.0), api.Request(prompts[6][:20], 5, 0.3, 40, 0.5)])
    dec.run([api.Request(prompts[7][:16], 17, 1.3, 2, 0.95), api.Request(prompts[8][:3], 9)])
  assert compiled == [], compiled


def test_drained_ring_reproduces_the_token_buffer_across_wraparound(tiny_model):
  (mcfg, hcfg, params, tok), cfg = tiny_model
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=3, k=3, ring_size=4), tok.eod_id)
  prompts = heldout_prompts(cfg, tok, 3, seed=7)
  state = eng.init_state()
  streams = [[], [], []]
  for slot, p in enumerate(prompts):
    prefix = eng.prefill(params, [p], jax.random.key(slot), [0.8], [0], [1.0])
    state = eng.insert(prefix, state, [slot], [60], 0.8, 0, 1.0)
    streams[slot].append(int(prefix.first[0]))
  drain = ring_lib.Drain()
  calls = 0
  while not bool(np.all(np.asarray(state.rows.done))):
    state = eng.generate(params, state, 3)          # 3 steps per call, ring of 4: wraps
    tokens, emitted, k_used, active = drain.drain(state.record.ring, int(state.record.step))
    ring_lib.append_streams(streams, tokens, emitted)
    assert np.all(k_used == 3)
    calls += 1
  assert int(state.record.step) > 2 * eng.cfg.ring_size, "no wrap-around happened"
  buf, length = np.asarray(state.rows.tokens), np.asarray(state.rows.length)
  for b, p in enumerate(prompts):
    assert streams[b] == buf[b, len(p): length[b]].tolist()


def test_donated_state_is_deleted_after_generate(tiny_model):
  (mcfg, hcfg, params, tok), cfg = tiny_model
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=2, k=2, ring_size=4), tok.eod_id)
  state = eng.init_state()
  prefix = eng.prefill(params, [[3, 4, 5]], jax.random.key(0), [0.0], [0], [1.0])
  state = eng.insert(prefix, state, [0], [10], 0.0, 0, 1.0)
  old = state
  new = eng.generate(params, state, 2, sample=False)
  assert old.rows.tokens.is_deleted() and old.caches.trunk.k[0].is_deleted()
  assert not new.rows.tokens.is_deleted()


def test_the_unembedding_copy_is_made_once_per_params(tiny_model):
  """Engine.unembed: the calls of an engine of several slots on CPU read one [D, V] copy of a
  tied embedding, made when params are first seen; new params get a copy of their own."""
  (mcfg, hcfg, params, tok), cfg = tiny_model
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=2, k=2), tok.eod_id)
  (copy,) = eng.unembed(params)
  if not (mcfg.tie_embeddings and jax.default_backend() == "cpu"):
    assert copy is None
    return
  assert eng.unembed(params)[0] is copy
  emb = np.asarray(params["trunk"]["embed_VD"], np.float32)
  np.testing.assert_array_equal(np.asarray(copy), emb.T)
  other = jax.tree.map(lambda x: x, params)
  other["trunk"] = dict(other["trunk"], embed_VD=jnp.asarray(emb * 2.0))
  np.testing.assert_array_equal(np.asarray(eng.unembed(other)[0]), 2.0 * emb.T)
  assert eng.unembed(params)[0] is not copy                      # remade for the first again
  # One slot: a fixed shape's every product has k + 1 rows (the copy); plain decoding's and
  # adaptive k's plain steps one (none).
  assert E.Engine(mcfg, hcfg, DecodeConfig(batch_size=1, k=2), tok.eod_id).unembed(
      params)[0] is not None
  for one in (DecodeConfig(batch_size=1, k=0), DecodeConfig(batch_size=1, adaptive=True)):
    assert E.Engine(mcfg, hcfg, one, tok.eod_id).unembed(params) == (None,)


def test_refill_ends_the_call_once_enough_rows_finish(tiny_model):
  """generate(refill=n): the call stops after the step in which the n-th row finishes (requests
  wait for those slots), or once the finished rows stood idle idle_steps slot-steps; refill=0
  runs every step asked for."""
  (mcfg, hcfg, params, tok), cfg = tiny_model
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=3, k=0, ring_size=16), tok.eod_id)
  prompts = heldout_prompts(cfg, tok, 3, seed=3)

  def fresh():
    state = eng.init_state()
    prefix = eng.prefill(params, prompts, jax.random.key(0), [0.0] * 3, [0] * 3, [1.0] * 3)
    # Plain decoding, no end token in the way: row r finishes after max_new - 1 steps.
    return eng.insert(prefix, state, [0, 1, 2], [4, 7, 40], [0.0] * 3, [0] * 3, [1.0] * 3)

  state = eng.generate(params, fresh(), 16, sample=False)
  assert int(state.record.step) == 16
  done_at = {}
  for refill, idle in ((1, np.inf), (2, np.inf), (2, 0), (2, 2)):
    state = eng.generate(params, fresh(), 16, sample=False, refill=refill, idle_steps=idle)
    done_at[refill, idle] = int(state.record.step)
    assert int(np.sum(np.asarray(state.rows.done))) >= (refill if idle == np.inf else 1)
  eod = tok.eod_id
  buf = np.asarray(state.rows.tokens)
  hit_eod = [eod in buf[r, len(p):].tolist() for r, p in enumerate(prompts)]
  if not any(hit_eod[:2]):       # row 0 frees its slot after step 3, row 1 after step 6
    assert done_at == {(1, np.inf): 3, (2, np.inf): 6, (2, 0): 3, (2, 2): 5}, done_at
  assert done_at[1, np.inf] <= done_at[2, np.inf] < 16


@pytest.mark.parametrize("k", [0, 2])
def test_a_closed_run_launches_no_chunk_past_its_rows_end(tiny_model, k):
  """Once no request waits, the next chunk is launched before the last one is drained, except
  where the chunk in flight ends every row by their token budgets: a run of max_new tokens
  takes at most ceil((max_new - 1) / ring_size) chunks (fewer where drafts are accepted or a
  row meets the end token), and its tokens are those of an unlimited number of chunks."""
  (mcfg, hcfg, params, tok), cfg = tiny_model
  prompts = heldout_prompts(cfg, tok, 2, seed=5)
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=k, ring_size=8))
  generate, calls = dec.engine.generate, []
  dec.engine.generate = lambda *a, **kw: calls.append(1) or generate(*a, **kw)
  full = [np.asarray(G.greedy_generate(dec.engine.graphdef, params, jnp.asarray([p], jnp.int32),
                                      jnp.asarray([len(p)], jnp.int32), 25))[0, len(p):].tolist()
          for p in prompts]
  for max_new in (9, 20, 25):
    calls.clear()
    got = dec.run([api.Request(p, max_new) for p in prompts])
    assert len(calls) <= -(-(max_new - 1) // 8), (max_new, len(calls))
    for ref, c in zip(full, got):
      ref = ref[:max_new]
      assert c.token_ids == (ref[: ref.index(tok.eod_id)] if tok.eod_id in ref else ref)


@pytest.mark.parametrize("sample", [False, True])
def test_one_pass_unembedding_keeps_the_output_exact(tiny_model, monkeypatch, sample):
  """With the heads unembedded in the trunk's product at every verified position (step._logits;
  here forced at every size), greedy output equals plain decoding and sampling stays lossless."""
  from mtp_jax.decoding import step as step_lib
  (mcfg, hcfg, params, tok), cfg = tiny_model
  made, logits = [], step_lib._logits

  def spy(*args):                   # runs as the step is traced
    out = logits(*args)
    made.append(out[1] is not None)
    return out
  monkeypatch.setattr(step_lib, "ONE_PASS_ROWS", 10**9)
  monkeypatch.setattr(step_lib, "_logits", spy)
  if not sample:
    prompts = heldout_prompts(cfg, tok, 5, seed=13)
    reqs = [api.Request(p, m) for p, m in zip(prompts, [30, 7, 40, 22, 35])]
    plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=0, ring_size=8))
    spec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=3, ring_size=8))
    assert [r.token_ids for r in spec.run(reqs)] == [r.token_ids for r in plain.run(reqs)]
    assert sum(spec.last_stats["accepted"]) > 0
  else:
    prompt = heldout_prompts(cfg, tok, 1, seed=3)[0][:12]
    a, _ = sample_engine(mcfg, hcfg, params, tok, 0, 24, 64, prompt, 3, seed=1)
    b, st = sample_engine(mcfg, hcfg, params, tok, 3, 24, 64, prompt, 3, seed=2)
    assert sum(st["accepted"]) > 0.1 * sum(st["drafted"]), st
    assert_same_distribution(second_and_third(a), second_and_third(b))
  assert any(made), "the heads were never unembedded with the trunk"
