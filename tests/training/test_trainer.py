"""Losses and training: shifted, masked head targets; a head loss that is not zero and falls;
heads_only leaves the trunk bit-identical; divergence stops with the last good checkpoint."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.decoding import shapes
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.models import model as M
from mtp_jax.training import losses
from mtp_jax.training import trainer as train_lib
from tests.conftest import tiny_config

EOD = 1


def test_head_targets_are_shifted_and_masked_at_ends():
  tokens = jnp.array([[10, 11, 12, 13, 14, 15]])      # W = 6, inputs t = 0..4
  tgt, mask = losses.head_targets(tokens, 2, EOD)
  # head 1 at t predicts token t+2; head 2 predicts t+3
  assert tgt[0, :, 0].tolist()[:4] == [12, 13, 14, 15]
  assert mask[0, :, 0].tolist() == [1, 1, 1, 1, 0]
  assert tgt[0, :, 1].tolist()[:3] == [13, 14, 15]
  assert mask[0, :, 1].tolist() == [1, 1, 1, 0, 0]


def test_head_targets_do_not_cross_end_of_document():
  tokens = jnp.array([[10, 11, EOD, 20, 21, 22, 23]])
  _, mask = losses.head_targets(tokens, 2, EOD)
  # t=0: head 1 target is token 2 (the EOD itself: allowed); head 2 target token 3 crosses it.
  assert mask[0, 0].tolist() == [1, 0]
  # t=1: tokens t+1.. include the EOD at 2 -> both heads masked.
  assert mask[0, 1].tolist() == [0, 0]
  assert mask[0, 2].tolist() == [1, 1]     # the EOD is the input; targets are in the new doc


def test_head_loss_is_not_zero_and_falls(trained_tiny):
  cfg, workdir, result = trained_tiny
  recs = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  train_recs = [r for r in recs if r["kind"] == "train"]
  first, last = train_recs[0], train_recs[-1]
  for i in range(1, cfg.heads.num + 1):
    assert last[f"head{i}_loss"] > 0.5, "the MTP loss must not be silently zero"
    assert last[f"head{i}_loss"] < first[f"head{i}_loss"] - 0.5
  assert last["trunk_loss"] < first["trunk_loss"] - 0.5
  assert result["perplexity"] > 1 and 0 <= result["head1_agree_tf"] <= 1
  assert any(r["kind"] == "eval" for r in recs)


def test_training_writes_the_models_token_trees_from_its_evaluation(trained_tiny):
  """The last evaluation's top-i acceptance per head (the trunk's own continuation of held-out
  prompts) goes to model/trees.json with a tree per default budget, built from those rates;
  head{i}_top8 is how often the trunk's token is among head i's top 8."""
  cfg, workdir, result = trained_tiny
  rates, trees = shapes.load_trees(os.path.join(workdir, "model", shapes.TREES_FILE))
  assert len(rates) == cfg.heads.num and all(len(r) == shapes.DEFAULT_TOP_K for r in rates)
  assert sorted(trees) == list(shapes.DEFAULT_BUDGETS)
  for b, tree in trees.items():
    assert tree.choices == shapes.build_tree(rates, b).choices
  for i in range(cfg.heads.num):
    assert result[f"head{i + 1}_top8"] == pytest.approx(sum(rates[i]), abs=1e-6)
    assert result[f"head{i + 1}_top8"] >= rates[i][0] >= 0.0
  assert sum(rates[0]) > 0.0
  assert shapes.tree_for(8, cfg.heads.num, os.path.join(workdir, "model")).choices == \
      trees[8].choices


def test_tiny_overfit_drives_head_loss_down():
  """On one repeated batch the heads learn their shifted targets."""
  cfg = tiny_config(train={"lr": 1e-2, "warmup_steps": 0, "steps": 60, "weight_decay": 0.0})
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, 64, (4, 20)), jnp.int32)
  graphdef, params = M.split(M.create(cfg.model, cfg.heads))
  tx = train_lib.make_optimizer(cfg)
  opt = tx.init(params)

  def loss(p):
    m = M.bind(graphdef, p)
    t, h = train_lib.compute_losses(m, tokens, EOD, "joint")
    return t + jnp.mean(h), h

  @jax.jit
  def step(p, o):
    (l, h), g = jax.value_and_grad(loss, has_aux=True)(p)
    u, o = tx.update(g, o, p)
    return jax.tree.map(lambda a, b: a + b, p, u), o, h

  h0 = None
  for i in range(60):
    params, opt, h = step(params, opt)
    h0 = h if h0 is None else h0
  assert np.all(np.asarray(h) < 0.3 * np.asarray(h0)), (h0, h)


def test_heads_only_keeps_trunk_bit_identical_and_has_no_trunk_optimizer_state(trained_tiny, tmp_path):
  cfg, workdir, _ = trained_tiny
  src = os.path.join(workdir, "model")
  _, _, before, _ = ckpt_lib.load_model_dir(src)
  for source in ("generated", "corpus"):
    hcfg = tiny_config(train={"mode": "heads_only", "init_from": src, "steps": 6,
                              "checkpoint_every": 3, "eval_every": 6, "distill_source": source,
                              "distill_target": "soft" if source == "corpus" else "hard"})
    out = str(tmp_path / source)
    train_lib.train(hcfg, out, log=lambda s: None)
    _, _, after, _ = ckpt_lib.load_model_dir(os.path.join(out, "model"))
    for a, b in zip(jax.tree.leaves(before["trunk"]), jax.tree.leaves(after["trunk"])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(before["heads"]), jax.tree.leaves(after["heads"])))
  trainable, frozen = train_lib.split_trainable(before, "heads_only")
  opt_state = train_lib.make_optimizer(hcfg).init(trainable)
  n_opt = sum(x.size for x in jax.tree.leaves(opt_state))
  assert n_opt <= 2 * M.count_params(before["heads"]) + 10
  assert "trunk" not in trainable


def test_nan_loss_stops_with_the_last_good_checkpoint(tmp_path, monkeypatch):
  cfg = tiny_config(train={"steps": 12, "checkpoint_every": 4, "log_every": 1, "eval_every": 100})
  real = train_lib.compute_losses

  def poisoned(m, tokens, *a, **k):
    trunk, heads = real(m, tokens, *a, **k)
    return trunk * jnp.where(m.trunk.final_norm.scale[0] < 10, jnp.nan, 1.0), heads

  # Six good steps (checkpoints at 4 and 6), then resume with a loss that turns NaN.
  train_lib.train(tiny_config(train={"steps": 6, "checkpoint_every": 4, "eval_every": 100}),
                  str(tmp_path), log=lambda s: None)
  monkeypatch.setattr(train_lib, "compute_losses", poisoned)
  with pytest.raises(train_lib.TrainingDiverged, match="loss is nan at step 7.*last good checkpoint is step 6"):
    train_lib.train(cfg, str(tmp_path), log=lambda s: None)
  assert ckpt_lib.TrainCheckpointer(str(tmp_path / "checkpoints"), 2).latest_step() == 6
