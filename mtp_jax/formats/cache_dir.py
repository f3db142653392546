"""What mtp-jax keeps between runs, under $XDG_CACHE_HOME/mtp_jax (~/.cache/mtp_jax): the adaptive
learned step costs, roofs and acceptance rates (tables.py) and XLA's compiled programs.

A decoder compiles its programs per draft shape set and batch size (10-50 s on 2 CPU cores,
27-33 s each on an H200); mtp-infer, mtp-train and
`make demo` point jax's persistent compilation cache here, so that the second run of a command
loads them (docs/batch.md measures what that saves). jax keys each entry by the program, the jax
and XLA versions, the device and the XLA flags, so a changed model or a new jax compiles afresh.
"""

import importlib.util
import os

import jax

CACHE_BYTES = 2**30   # least recently used programs are evicted beyond this much disk


def root() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mtp_jax")


def enable_compilation_cache() -> str | None:
  """Points jax's persistent compilation cache at root()/xla, unless the user set a directory of
  their own (JAX_COMPILATION_CACHE_DIR) or turned it off (JAX_ENABLE_COMPILATION_CACHE=false).
  -> the directory in use, or None. A jax whose config lacks these options runs uncached."""
  config = jax.config
  try:
    if not config.jax_enable_compilation_cache:
      return None
    if config.jax_compilation_cache_dir is None:
      config.update("jax_compilation_cache_dir", os.path.join(root(), "xla"))
      # jax evicts under a file lock (`filelock`, which tokenizers' hub client brings).
      if config.jax_compilation_cache_max_size == -1 and importlib.util.find_spec("filelock"):
        config.update("jax_compilation_cache_max_size", CACHE_BYTES)
      # Every program, not only those over jax's default 1 s: a run's many small ones (prefill,
      # insert) add up to a quarter of `make demo`'s time.
      config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return config.jax_compilation_cache_dir
  except AttributeError:
    return None
