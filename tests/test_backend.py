"""Per-backend defaults: command buffers for WHILE and CONDITIONAL where a GPU will run, nothing on
the CPU, and a user's own XLA_FLAGS for them left alone."""

import subprocess
import sys

from mtp_jax import backend


def test_gpu_gets_command_buffers_and_keeps_other_flags():
  env = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  assert backend.xla_flags(env) == "--xla_dump_to=/tmp/x " + backend.COMMAND_BUFFERS
  assert backend.xla_flags({"JAX_PLATFORMS": "gpu"}) == backend.COMMAND_BUFFERS
  assert backend.xla_flags({"JAX_PLATFORMS": "cuda,cpu"}) == backend.COMMAND_BUFFERS


def test_cpu_and_the_users_own_flag_are_left_alone():
  assert backend.xla_flags({"JAX_PLATFORMS": "cpu"}) is None
  assert backend.xla_flags({"JAX_PLATFORMS": "cpu,cuda"}) is None      # the first one runs
  off = {"JAX_PLATFORMS": "cuda", "XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
  assert not backend.apply_defaults(off) and off["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer="


def test_this_machine_and_a_started_backend():
  """Without JAX_PLATFORMS the installed plugins decide (none here: the CPU gets nothing); once a
  backend runs, XLA_FLAGS is read already and nothing is changed."""
  code = ("import os, jax; from mtp_jax import backend; env = dict(os.environ);"
          "env.pop('JAX_PLATFORMS', None); before = backend.xla_flags(env);"
          "jax.devices(); print(jax.default_backend(), before is not None,"
          " backend.apply_defaults({'JAX_PLATFORMS': 'cuda'}))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  platform, gpu_flags, applied = out.stdout.split()
  assert gpu_flags == str(platform == "gpu") and applied == "False"
