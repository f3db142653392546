"""`mtp-train --config=configs/tiny.py --workdir=DIR` leaves a model directory that loads."""

import os
import subprocess
import sys

from mtp_jax.formats import checkpoint as C
from tests.helpers import ROOT


def test_cli_trains_tiny_and_writes_a_model_dir(tmp_path):
  wd = str(tmp_path / "run")
  r = subprocess.run([sys.executable, "-m", "train.main", "--config=configs/tiny.py",
                      f"--workdir={wd}", "--config.train.steps=12", "--config.train.log_every=4"],
                     cwd=ROOT, capture_output=True, text=True, timeout=600,
                     env=dict(os.environ, PYTHONPATH=ROOT))
  assert r.returncode == 0, r.stderr[-3000:]
  assert "step 12/12" in r.stderr and "tok/s" in r.stderr and "ETA" in r.stderr
  mcfg, hcfg, params, tok = C.load_model_dir(os.path.join(wd, "model"))
  assert mcfg.d_model == 64 and hcfg.num == 4
  assert os.path.exists(os.path.join(wd, "metrics.jsonl"))


def test_cli_bad_override_is_one_clear_line(tmp_path):
  r = subprocess.run([sys.executable, "-m", "train.main", "--config=configs/tiny.py",
                      f"--workdir={tmp_path}", "--config.model.n_kv_heads=3"],
                     cwd=ROOT, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, PYTHONPATH=ROOT))
  assert r.returncode == 1
  assert "model.n_kv_heads=3: must divide model.n_heads=4" in r.stderr
