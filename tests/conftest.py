"""Shared fixtures: the tiny configuration and one trained tiny workdir per test session."""

import atexit
import os
import shutil
import tempfile

import jax
import pytest

from configs import tiny
from mtp_jax import config as config_lib
from mtp_jax.training import trainer as train_lib

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")
# What mtp-jax keeps between runs (cost tables, stored acceptance, compiled programs: cache_dir)
# goes to a directory of this test process, its CLIs' subprocesses included: nothing a user's
# runs stored changes a test, and the tests store nothing in the user's home.
_CACHE_HOME = tempfile.mkdtemp(prefix="mtp_jax_tests_")
os.environ["XDG_CACHE_HOME"] = _CACHE_HOME
atexit.register(shutil.rmtree, _CACHE_HOME, True)

# Compiled programs, though, are shared by the processes of one session (pytest-xdist's workers
# inherit the directory the first process made): many tests build engines of one configuration,
# and XLA's compiles are most of the suite's time. A program is keyed by its whole text, so a
# shared entry changes no result; every program is stored, not only those over jax's 1 s.
_XLA_ENV = "MTP_JAX_TESTS_XLA_CACHE"
if _XLA_ENV not in os.environ:
  os.environ[_XLA_ENV] = tempfile.mkdtemp(prefix="mtp_jax_tests_xla_")
  atexit.register(shutil.rmtree, os.environ[_XLA_ENV], True)
jax.config.update("jax_compilation_cache_dir", os.environ[_XLA_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def tiny_config(**sections) -> config_lib.Config:
  d = tiny.get_config().to_dict()
  for section, fields in sections.items():
    d[section].update(fields)
  return config_lib.Config.from_dict(d)


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
  """A tiny joint run (the `mtp-train --config=configs/tiny.py` recipe, fewer steps)."""
  workdir = str(tmp_path_factory.mktemp("tiny_run"))
  cfg = tiny_config(train={"steps": 40, "eval_every": 40, "checkpoint_every": 20})
  result = train_lib.train(cfg, workdir, log=lambda s: None)
  return cfg, workdir, result
