"""Sharding: the mesh and rules in-process; equivalence with one device on 8 simulated CPU
devices in a fresh process (tests/sharded_checks.py), since the device count is fixed when JAX
starts."""

import os
import subprocess
import sys

import pytest

from mtp_jax import config as config_lib
from mtp_jax import sharding as S
from tests.helpers import ROOT


def test_mesh_spec_and_rules():
  assert S.parse_shape("data:2,model:4") == {"data": 2, "model": 4}
  assert S.parse_shape("") == {"data": -1, "model": 1}
  for bad, what in [("data:0", "size must be >= 1"), ("pipe:2", "AXIS:SIZE"),
                    ("data=2", "AXIS:SIZE")]:
    with pytest.raises(config_lib.ConfigError, match=what):
      S.parse_shape(bad)
  with pytest.raises(config_lib.ConfigError, match="needs 16 devices, 1 are visible"):
    S.make_mesh("data:4,model:4")
  with pytest.raises(config_lib.ConfigError, match="mesh.rules: mlp='pipe'"):
    config_lib.MeshConfig(rules="mlp=pipe")
  assert S.logical_axes("wq_DNH", 3) == ("embed", "heads", "head_dim")
  assert S.logical_axes("embed_VD", 2) == ("vocab", "embed")
  assert S.logical_axes("scale", 1) == ("embed",)
  assert S.logical_axes("count", 0) == ()


def _run(case, tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  r = subprocess.run([sys.executable, "-m", "tests.sharded_checks", case, str(tmp_path)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-3000:] + r.stderr[-3000:]
  return r.stdout


@pytest.mark.slow
def test_sharded_train_step_equals_one_device(tmp_path):
  out = _run("train_steps", tmp_path)
  assert "data:2,model:4" in out


@pytest.mark.slow
def test_sharded_decode_and_restore_across_meshes(tmp_path):
  out = _run("decode_and_restore", tmp_path)
  assert "model:8" in out and "data:8" in out
