"""Adaptive k choosing among chains and token trees (shape_set.py): the expected tokens of a
tree, which trees the cost table leaves, greedy output equal to plain greedy decoding and lossless
sampling while trees are chosen, no recompiles, and what cannot choose a tree says so."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import ConfigError, DecodeConfig, HeadsConfig
from mtp_jax.decoding import engine as E
from mtp_jax.decoding import loop as loop_lib
from mtp_jax.decoding import shape_set as SS
from mtp_jax.decoding import shapes as S
from mtp_jax.decoding import tables as T
from mtp_jax.decoding import tree_verify as TV
from mtp_jax.decoding.shape_set import resolve
from mtp_jax.serving import api
from tests.conftest import tiny_config
from tests.helpers import (
  assert_same_distribution,
  compiles,
  heldout_prompts,
  sample_rounds,
  second_and_third,
)
from tests.decoding.test_tree_engine import DEEP, WIDE, plain_runs, tiny_model  # noqa: F401 (fixtures)

RATES = ((0.6, 0.2, 0.1, 0.05), (0.5, 0.2, 0.1, 0.05), (0.4, 0.2, 0.1, 0.05),
         (0.3, 0.2, 0.1, 0.05))


def _brute_expected(tree, alpha, rates):
  """1 + sum over nodes of the product of p(depth, rank) along the path (shape_set's model)."""
  total = 1.0
  for path in tree.choices:
    v = 1.0
    for d, r in enumerate(path):
      v *= alpha[d] if r == 0 else (1 - alpha[d]) * rates[d][r] / (1 - rates[d][0])
    total += v
  return total


def test_expected_tokens_of_chains_and_trees():
  trees = (S.Tree.from_choices(WIDE), S.Tree.from_choices(DEEP))
  ss = SS.ShapeSet(kd=4, trees=trees, rates=RATES)
  alpha = np.asarray([0.7, 0.5, 0.45, 0.2], np.float32)
  e = np.asarray(ss.expected(jnp.asarray(alpha)))
  assert e.shape == (ss.size,) == (7,)
  chain = [1.0] + list(1.0 + np.cumsum(np.cumprod(alpha)))
  np.testing.assert_allclose(e[:5], chain, rtol=1e-6)
  for i, tree in enumerate(trees):
    np.testing.assert_allclose(e[5 + i], _brute_expected(tree, alpha, RATES), rtol=1e-6)
  # A cut at depth 1 (one fresh draft): nothing deeper counts, in chains and trees alike.
  cut = jnp.asarray([[True, False, False, False]])
  e1 = np.asarray(ss.expected(jnp.asarray(alpha)[None], cut))[0]
  np.testing.assert_allclose(e1, [1, 1.7, 1.7, 1.7, 1.7, 1 + 0.7 + 0.3 * (2 / 4 + 1 / 4),
                                  1 + 0.7 + 0.3 * 2 / 4], rtol=1e-6)
  assert SS.chain_depth(trees[0]) == 3 and SS.chain_depth(trees[1]) == 4


def test_the_accepted_paths_rank_zero_prefix_and_the_depth_limit():
  tree = S.Tree.from_choices(WIDE)        # nodes (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0) (0,0,1)
  path = jnp.asarray([[0, 3, 6], [0, 4, -1], [1, 5, -1], [-1, -1, -1], [0, 3, 7]])
  assert TV.chain_accepted(tree, path).tolist() == [3, 1, 0, 0, 2]
  # Greedy: targets agree with the deepest path (0, 0, 0); a limit of 1 keeps depth 1 alone.
  v = 8
  nodes = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 0]] * 2)
  targets = np.zeros((2, tree.size + 1), np.int64)
  targets[:, 0], targets[:, 1], targets[:, 4] = 1, 4, 7      # root -> 1, (0,) -> 4, (0,0) -> 7
  logits = jax.nn.one_hot(jnp.asarray(targets), v) * 10.0
  out = TV.verify_greedy(tree, nodes, logits, jnp.asarray([3, 1]))
  assert out.accepted_B.tolist() == [3, 1]
  assert out.tokens_BD[1, :2].tolist() == [1, 4]           # the draft, then the trunk's token
  key = jax.random.key(0)
  out = TV.verify_sampling(key, tree, nodes, jnp.log(jnp.maximum(logits / 10.0, 1e-30)),
                           limit_B=jnp.asarray([3, 1]))
  assert out.accepted_B.tolist() == [3, 1]


def _auto(tiny, cost, **opts):
  """An adaptive decoder of the tiny model choosing among chains and WIDE / DEEP under `cost`."""
  (mcfg, hcfg, params, tok), _, _ = tiny
  dcfg = DecodeConfig(batch_size=3, adaptive=True, ring_size=8, adaptive_trees=(WIDE, DEEP),
                      **opts)
  dec = api.Decoder(mcfg, hcfg, params, tok, dcfg)
  dec.fix_costs(cost)
  return dec


# Chains cost 10 plain steps (never chosen): only a tree can emit more than one token a step.
TREES_ONLY = [1.0, 10.0, 10.0, 10.0, 10.0, 1.01, 1.02]
EVERY_SHAPE = [1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06]


@pytest.mark.parametrize("cost, penalty", [(TREES_ONLY, False), (EVERY_SHAPE, True)])
def test_greedy_output_equals_plain_greedy_while_trees_are_chosen(tiny_model, plain_runs,  # noqa: F811
                                                                  cost, penalty):
  """Rows of different lengths, refills, a stop string (plain_runs); the controller's choices
  move between trees (and chains), rows holding one fresh draft after a probe verify no deeper."""
  reqs, want = plain_runs(penalty)
  dec = _auto(tiny_model, cost)
  assert max(dec.engine.ks) > dec.engine.kd, dec.engine.ks
  got = dec.run(reqs)
  for a, b in zip(want, got):
    assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
  st = dec.last_stats
  if cost is TREES_ONLY:
    assert st["acceptance_length"] > 1.2, st    # tree steps ran and accepted drafts


def test_sampling_is_lossless_while_trees_are_chosen(tiny_model):  # noqa: F811
  """As the chain's test (tests/decoding/test_engine.py): the 2nd and 3rd sampled tokens, from steps the
  controller runs with the trees alone, follow plain sampling's distribution."""
  _sampling_matches_plain(tiny_model, TREES_ONLY)


def _sampling_matches_plain(tiny_model, cost, force_chain: bool = False):  # noqa: F811
  """The 2nd and 3rd sampled tokens of an adaptive engine with trees (cost: its cost table;
  force_chain: every step the chain of all heads) follow plain sampling's distribution
  (two-sample chi-square, fails below p = 1e-4)."""
  (mcfg, hcfg, params, tok), cfg, _ = tiny_model
  prompt = heldout_prompts(cfg, tok, 1, seed=3)[0][:12]
  plain = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=64, k=0, ring_size=8), tok.eod_id)
  auto = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=64, adaptive=True, ring_size=8,
                                           adaptive_trees=(WIDE, DEEP)), tok.eod_id)
  auto.cost = cost
  if force_chain:
    assert max(auto.ks) > auto.kd                    # trees compiled: drafts are ranked
    init = auto.init_state
    auto.init_state = lambda *a, **kw: auto.put(init(*a, **kw), k_force=auto.kd)
  a, _ = sample_rounds(params, plain, prompt, seed=1)
  b, st = sample_rounds(params, auto, prompt, seed=2)
  assert st["acceptance_length"] > 1.1, st
  assert_same_distribution(second_and_third(a), second_and_third(b))


@pytest.mark.slow
def test_no_recompilation_after_warmup_with_trees_chosen(tiny_model):  # noqa: F811
  (_, _, _, _), cfg, _ = tiny_model
  dec = _auto(tiny_model, EVERY_SHAPE)
  prompts = heldout_prompts(cfg, tiny_model[0][3], 6, seed=5)
  dec.warmup(max_prompt_len=16)
  with compiles() as compiled:
    dec.run([api.Request(prompts[2][:12], 20), api.Request(prompts[3][:9], 3)])
    dec.run([api.Request(prompts[4][:14], 11, 1.0, 0, 1.0), api.Request(prompts[5][:7], 30)])
  assert compiled == [], compiled


def test_auto_takes_the_models_trees_and_what_cannot_choose_a_tree_says_so(tiny_model):  # noqa: F811
  _, _, workdir = tiny_model
  model_dir = os.path.join(workdir, "model")
  dec = api.Decoder.load(model_dir, batch_size=2, k="auto")
  hnum = dec.engine.heads_cfg.num
  want = [S.tree_for(b, hnum, model_dir) for b in SS.ADAPTIVE_BUDGETS]
  want = [t for t in dict.fromkeys(want) if SS.chain_depth(t) < t.size]
  assert list(dec.engine.shape_set.trees) == want and want
  assert dec.engine.span == dec.engine.kd           # trees need room only when chosen
  assert api.Decoder.load(model_dir, batch_size=2, k="auto",
                          adaptive_trees=()).engine.shape_set.trees == ()
  cfg = tiny_config()
  mcfg, hcfg = cfg.model, cfg.heads
  for dcfg, hc, field in [
      (DecodeConfig(adaptive_trees=(WIDE,)), hcfg, "decode.adaptive"),
      (DecodeConfig(adaptive=True, adaptive_trees=(WIDE,), drafter="ngram", k=3), hcfg,
       "decode.drafter"),
      (DecodeConfig(adaptive=True, adaptive_trees=(WIDE,), confidence_threshold=0.5), hcfg,
       "decode.confidence_threshold"),
      (DecodeConfig(adaptive=True, adaptive_trees=(WIDE,)), HeadsConfig(kind="sequential", num=4),
       "heads.kind"),
      (DecodeConfig(adaptive=True, adaptive_trees=(DEEP,), k=3), hcfg, "decode.adaptive_trees"),
      (DecodeConfig(adaptive=True, adaptive_trees=(((0,), (0, 0)),)), hcfg,
       "decode.adaptive_trees"),
      (DecodeConfig(adaptive=True, adaptive_trees=(WIDE,), tree_rates=((0.5, 0.2),)), hcfg,
       "decode.tree_rates")]:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      resolve(dcfg, mcfg, hc)


def test_the_learned_costs_have_an_entry_per_tree(tiny_model, tmp_path):  # noqa: F811
  """The learner prices every chain and every tree from the roofline, compiles the best chain
  first (a tree only once the controller wants it), and stores what a run taught it under a
  key naming the trees; a later decoder starts from the stored costs."""
  (mcfg, hcfg, params, tok), cfg, _ = tiny_model
  dcfg = DecodeConfig(batch_size=3, adaptive=True, ring_size=8, adaptive_trees=(WIDE, DEEP))
  dec = api.Decoder(mcfg, hcfg, params, tok, dcfg)
  path = str(tmp_path / "tables.json")
  dec.cost_table(path)
  dec.run([api.Request(heldout_prompts(cfg, tok, 1, seed=4)[0][:20], 40)])
  eng = dec.engine
  assert len(eng.cost) == eng.n_shapes == eng.kd + 1 + 2 and all(0 < c < np.inf for c in eng.cost)
  assert max(eng.ks) <= eng.kd or dec.learner.wanted[max(eng.ks)] >= 8      # OPEN_AFTER
  key = T.table_key(eng)
  assert "|trees=" in key and "|trees=none" not in key
  stored = T.load_table(path, key, eng.n_shapes)
  assert stored["cost_s"] == list(dec.learner.model.mean)
  again = api.Decoder(mcfg, hcfg, params, tok, dcfg)
  again.cost_table(path)
  again.warmup(32)
  np.testing.assert_allclose(again.learner.model.mean, stored["cost_s"], rtol=1e-6)


def test_no_tree_where_a_row_lacks_room_for_it(tiny_model):  # noqa: F811
  """Rows keep Kd + 1 positions free, not a tree's T + 1: near the cache's end the controller
  leaves the trees out, and a row decodes to the last position a chain can use, exactly."""
  (mcfg, hcfg, params, tok), cfg, _ = tiny_model
  prompt = heldout_prompts(cfg, tok, 1, seed=4)[0][:20]
  chain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=1, k=4, max_len=48))
  want = chain.run([api.Request(prompt, 500)])[0]
  dec = _auto(tiny_model, TREES_ONLY, max_len=48)
  assert dec.engine.span == dec.engine.kd
  got = dec.run([api.Request(prompt, 500)])[0]
  assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
  if got.finish_reason == "length":
    assert len(prompt) + len(got.token_ids) == 48 - dec.engine.kd - 1
  state = dec.engine.init_state()
  state = state.replace(rows=state.rows.replace(done=state.rows.done.at[0].set(False),
                                                length=state.rows.length.at[0].set(30)))
  # 30 + 3 steps x 5 tokens = 45: WIDE's 8 nodes do not fit 48 positions, nor DEEP's 6.
  assert np.asarray(loop_lib.allowed(dec.engine, state, dec.engine.ks)).tolist() == [
      True, True, True, True, True, False, False]
  state = state.replace(rows=state.rows.replace(length=state.rows.length.at[0].set(20)))
  assert np.asarray(loop_lib.allowed(dec.engine, state, dec.engine.ks)).tolist() == [True] * 7
  assert np.asarray(loop_lib.allowed(dec.engine, state, (0, 5))).tolist() == [
      True, False, False, False, False, True, False]


@pytest.mark.slow
def test_chain_steps_of_ranked_drafts_are_lossless(tiny_model):  # noqa: F811
  """Where a tree is viable every drafting step draws each head's candidates without
  replacement (Gumbel top-k); a chain step then verifies rank 0 of them against the q they came
  from. Forced to the chain of all heads, the 2nd and 3rd sampled tokens follow plain
  sampling's distribution."""
  _sampling_matches_plain(tiny_model, EVERY_SHAPE, force_chain=True)
