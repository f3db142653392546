"""Tree drafts through the engine (DecodeConfig.tree, Decoder.load(k='tree:T')): greedy tree
decoding equals plain greedy decoding token for token, sampled tree decoding is lossless,
nothing compiles after warm-up, and what cannot draft a tree says so."""

import os

import pytest

from infer import checks
from mtp_jax.bench import benchmark
from mtp_jax.config import ConfigError, DecodeConfig, HeadsConfig
from mtp_jax.decoding import engine as E
from mtp_jax.decoding import shapes as S
from mtp_jax.decoding.shape_set import resolve
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.serving import api
from tests.conftest import tiny_config
from tests.helpers import (
  assert_same_distribution,
  compiles,
  heldout_prompts,
  sample_rounds,
  second_and_third,
)

# Several children at depths 1 and 2: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0) (0,0,1)
WIDE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1))
# As deep as the tiny model's 4 heads, two children at depth 1 and 2.
DEEP = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0))


@pytest.fixture(scope="module")
def tiny_model(trained_tiny):
  cfg, workdir, _ = trained_tiny
  return ckpt_lib.load_model_dir(os.path.join(workdir, "model")), cfg, workdir


@pytest.fixture(scope="module")
def plain_runs(tiny_model):
  """The requests of the greedy tests (7 of them for 3 slots: refills; one with a stop string;
  with `penalty` a greedy row with a repetition penalty, which runs the sampled variant) and
  plain decoding's completions of them."""
  (mcfg, hcfg, params, tok), cfg, _ = tiny_model
  plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=3, k=0, ring_size=8))
  prompts = heldout_prompts(cfg, tok, 7)
  max_new = [5, 40, 17, 33, 1, 26, 40]
  base = [api.Request(p, m) for p, m in zip(prompts, max_new)]
  # The last request stops halfway: no request waits for its slot then (a slot refilled right
  # after a stop string is cancelled with the row it served: the refill loop's, not the tree's).
  text = plain.run(base)[6].text
  assert len(text) > 10, text
  stop = text[len(text) // 2: len(text) // 2 + 3]
  memo = {}

  def run(penalty: bool):
    if penalty not in memo:
      reqs = list(base)
      reqs[6] = api.Request(prompts[6], 40, stop=(stop,))
      if penalty:
        reqs[3] = api.Request(prompts[3], 33, repetition_penalty=1.8)
      memo[penalty] = reqs, plain.run(reqs)
    return memo[penalty]
  return run


@pytest.mark.parametrize("tree, penalty", [(WIDE, False), (DEEP, False), ("tree:6", True)])
def test_greedy_tree_decoding_equals_plain_greedy(tiny_model, plain_runs, tree, penalty):
  """Rows of different lengths, refills, a stop string; 'tree:6' is Decoder.load's default
  tree for 6 nodes, beside a greedy row with a repetition penalty (the sampled variant, whose
  one-hot distributions reduce to the greedy rule)."""
  (mcfg, hcfg, params, tok), _, workdir = tiny_model
  reqs, want = plain_runs(penalty)
  if isinstance(tree, str):
    model_dir = os.path.join(workdir, "model")
    dec = api.Decoder.load(model_dir, batch_size=3, k=tree, ring_size=8)
    assert dec.engine.tree == S.tree_for(6, hcfg.num, model_dir)
  else:
    dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=3, tree=tree,
                                                            ring_size=8))
  got = dec.run(reqs)
  for a, b in zip(want, got):
    assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
  assert want[6].finish_reason == "stop" and len(want[6].token_ids) < 40
  st = dec.last_stats
  assert sum(st["accepted"]) > 0, "no draft was ever accepted: the test would prove nothing"
  assert len(st["drafted"]) == dec.engine.tree.max_depth


def test_rows_stop_before_the_tree_leaves_the_cache(tiny_model):
  """A row keeps T + 1 positions free for the tree step (not k + 1)."""
  (mcfg, hcfg, params, tok), _, _ = tiny_model
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=1, tree=WIDE, max_len=48))
  out = dec.run([api.Request([7] * 20, 500)])[0]
  if out.finish_reason == "length":
    assert 20 + len(out.token_ids) == 48 - len(WIDE) - 1


@pytest.mark.parametrize("penalty", [1.0, pytest.param(3.0, marks=pytest.mark.slow)])
def test_sampled_tree_decoding_is_lossless(tiny_model, penalty):
  """The 2nd and 3rd generated tokens (from tree steps; the 1st comes from prefill) follow
  plain sampling's distribution: top-k 4 leaves the heads' q four tokens, so the tree's three
  candidates at the root are tried one after another (recursive rejection); with a penalty,
  each node is judged against the history plus its own path. Chi-square homogeneity of the
  joint pairs, as the chain's test (fails below p = 1e-4)."""
  (mcfg, hcfg, params, tok), cfg, _ = tiny_model
  prompt = heldout_prompts(cfg, tok, 1, seed=3)[0][:12]
  plain = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=64, k=0, ring_size=8), tok.eod_id)
  tree = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=64, tree=WIDE, ring_size=8), tok.eod_id)
  a, _ = sample_rounds(params, plain, prompt, seed=1, penalty=penalty)
  b, st = sample_rounds(params, tree, prompt, seed=2, penalty=penalty)
  assert sum(st["accepted"]) > 0.1 * sum(st["drafted"]), st
  assert_same_distribution(second_and_third(a), second_and_third(b))


def test_no_recompilation_after_warmup_with_a_tree(tiny_model):
  (mcfg, hcfg, params, tok), cfg, _ = tiny_model
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, tree=WIDE, ring_size=8))
  prompts = heldout_prompts(cfg, tok, 9, seed=5)
  assert dec.warmup(max_prompt_len=16) == 1             # one bucket: the tree's variants count
  with compiles() as compiled:
    dec.run([api.Request(prompts[2][:12], 20), api.Request(prompts[3][:9], 3)])
    dec.run([api.Request(prompts[4][:14], 11, 1.0, 0, 1.0), api.Request(prompts[5][:7], 30),
             api.Request(prompts[6][:15], 5, 0.3, 40, 0.5)])
    dec.run([api.Request(prompts[7][:16], 17, 1.3, 2, 0.95, 1.2),
             api.Request(prompts[8][:3], 9)])
  assert compiled == [], compiled


def test_what_cannot_draft_a_tree_says_so():
  cfg = tiny_config()
  mcfg, hcfg = cfg.model, cfg.heads
  assert resolve(DecodeConfig(tree=WIDE), mcfg, hcfg).k == 3
  for dcfg, hc, field in [
      (DecodeConfig(tree=WIDE, adaptive=True), hcfg, "decode.adaptive"),
      (DecodeConfig(tree=WIDE, drafter="ngram", k=3), hcfg, "decode.drafter"),
      (DecodeConfig(tree=WIDE, confidence_threshold=0.5), hcfg, "decode.confidence_threshold"),
      (DecodeConfig(tree=WIDE, k=2), hcfg, "decode.k"),
      (DecodeConfig(tree=DEEP), HeadsConfig(kind="parallel", num=3), "decode.tree"),
      (DecodeConfig(tree=WIDE), HeadsConfig(kind="sequential", num=4), "heads.kind"),
      (DecodeConfig(tree=((1,),)), hcfg, "decode.tree"),
      (DecodeConfig(tree=WIDE, max_len=9), hcfg, "decode.max_len")]:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
      resolve(dcfg, mcfg, hc)
  assert S.tree_budget("tree:16") == 16 and S.tree_budget("3") is None
  assert benchmark.parse_mode("tree:8") == ("heads", "tree:8")
  with pytest.raises(S.ShapeError, match="tree:T"):
    S.tree_budget("tree:x")
  for ok in ("tree:16", "auto", "3", "-1"):
    checks.k_spec("k", ok, lo=-1)
  for bad in ("tree:0", "tree:", "tree:x", "-2", "chain:3"):
    with pytest.raises(checks.FlagError, match=f"--k={bad}: .*tree:T"):
      checks.k_spec("k", bad, lo=-1)
