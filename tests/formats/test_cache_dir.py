"""The CLIs' persistent compilation cache: where it goes, and that a user's own setting wins."""

import os
import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = """
import jax, jax.numpy as jnp
from mtp_jax.formats import cache_dir
print(cache_dir.enable_compilation_cache())
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()
"""


def _run(tmp_path, **env):
  env = {**{k: v for k, v in os.environ.items() if not k.startswith("JAX_")},
         "XDG_CACHE_HOME": str(tmp_path / "home"), "JAX_PLATFORMS": "cpu", **env}
  out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True,
                       text=True, check=True)
  return out.stdout.strip().splitlines()[-1]


def test_programs_are_kept_under_the_cache_home(tmp_path):
  path = _run(tmp_path)
  assert path == str(tmp_path / "home" / "mtp_jax" / "xla")
  assert os.listdir(path), "no compiled program was written"


def test_a_users_own_directory_or_opt_out_wins(tmp_path):
  own = tmp_path / "own"
  assert _run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(own),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0") == str(own)
  assert os.listdir(own)
  assert _run(tmp_path, JAX_ENABLE_COMPILATION_CACHE="false") == "None"
  assert not (tmp_path / "home" / "mtp_jax" / "xla").exists()
