"""Model directories and training checkpoints: round trip, clear errors, kill-and-resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from mtp_jax.formats import checkpoint as C
from mtp_jax.models import model as M
from mtp_jax.training import trainer as train_lib
from tests.conftest import tiny_config
from tests.helpers import ROOT


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_model_dir_round_trip(trained_tiny, tmp_path):
  cfg, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = C.load_model_dir(os.path.join(workdir, "model"))
  assert (mcfg, hcfg) == (cfg.model, cfg.heads)
  out = str(tmp_path / "copy")
  C.save_model_dir(out, cfg, params, tok)
  _, _, params2, tok2 = C.load_model_dir(out)
  _assert_trees_equal(params, params2)
  assert tok2.encode("x = 1") == tok.encode("x = 1")
  # bf16 storage loads back as f32 parameters within bf16 rounding.
  C.save_model_dir(out, cfg, params, tok, dtype="bfloat16")
  _, _, p16, _ = C.load_model_dir(out)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(p16)):
    assert y.dtype == np.float32
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-2, atol=1e-2)


def test_model_dir_errors_are_one_clear_message(trained_tiny, tmp_path):
  cfg, workdir, _ = trained_tiny
  src = os.path.join(workdir, "model")
  with pytest.raises(C.ModelDirError, match="model directory not found"):
    C.load_model_dir(str(tmp_path / "nope"))
  bad = str(tmp_path / "bad")
  shutil.copytree(src, bad)
  os.remove(os.path.join(bad, "tokenizer.json"))
  with pytest.raises(C.ModelDirError, match="missing tokenizer.json"):
    C.load_model_dir(bad)
  # A config that does not match the parameters.
  shutil.rmtree(bad)
  shutil.copytree(src, bad)
  d = json.load(open(os.path.join(bad, "config.json")))
  d["model"]["d_ff"] += 8
  json.dump(d, open(os.path.join(bad, "config.json"), "w"))
  with pytest.raises(C.ModelDirError, match="parameter .*down_FD has shape"):
    C.load_model_dir(bad)
  d["model"]["n_heads"] = 5
  json.dump(d, open(os.path.join(bad, "config.json"), "w"))
  with pytest.raises(C.ModelDirError, match="model.n_heads=5"):
    C.load_model_dir(bad)
  # A damaged checkpoint: truncate every data file of the parameters.
  shutil.rmtree(bad)
  shutil.copytree(src, bad)
  for dirpath, _, files in os.walk(os.path.join(bad, "params")):
    for f in files:
      open(os.path.join(dirpath, f), "wb").close()
  with pytest.raises(C.ModelDirError, match="params: damaged or unreadable checkpoint"):
    C.load_model_dir(bad)


def test_checkpoint_round_trip_of_train_state(tmp_path):
  cfg = tiny_config()
  _, params = M.split(M.create(cfg.model, cfg.heads))
  tx = train_lib.make_optimizer(cfg)
  opt = tx.init(params)
  ck = C.TrainCheckpointer(str(tmp_path), 2)
  ck.save(7, params, opt, {"next_batch": 7, "seed": 0})
  abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  p2, o2, d2 = ck.restore(7, abstract(params), abstract(opt))
  _assert_trees_equal(params, p2)
  _assert_trees_equal(opt, o2)
  assert d2 == {"next_batch": 7, "seed": 0}


def _train_cmd(workdir, steps):
  return [sys.executable, "-m", "train.main", "--config=configs/tiny.py", f"--workdir={workdir}",
          f"--config.train.steps={steps}", "--config.train.checkpoint_every=5",
          "--config.train.log_every=1", "--config.train.eval_every=1000"]


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted(tmp_path):
  steps = 20
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  env = dict(os.environ, PYTHONPATH=ROOT)
  subprocess.run(_train_cmd(straight, steps), cwd=ROOT, env=env, check=True,
                 capture_output=True, timeout=600)
  proc = subprocess.Popen(_train_cmd(killed, steps), cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  metrics = os.path.join(killed, "metrics.jsonl")
  deadline = time.time() + 300
  # Kill between checkpoints: after step 7 was logged (checkpoint 5 exists, 10 does not yet).
  while time.time() < deadline:
    if os.path.exists(metrics) and any(json.loads(l)["step"] >= 7 for l in open(metrics)
                                       if l.strip().endswith("}")):
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not os.path.exists(os.path.join(killed, "model")), "killed too late to test resume"
  subprocess.run(_train_cmd(killed, steps), cwd=ROOT, env=env, check=True,
                 capture_output=True, timeout=600)
  _, _, a, _ = C.load_model_dir(os.path.join(straight, "model"))
  _, _, b, _ = C.load_model_dir(os.path.join(killed, "model"))
  _assert_trees_equal(a, b)
  recs = [json.loads(l) for l in open(metrics)]
  steps_logged = [r["step"] for r in recs if r["kind"] == "train"]
  assert steps_logged == sorted(set(steps_logged)), "metrics repeat steps after resume"
