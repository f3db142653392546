"""Per-backend defaults that must be in place before JAX starts a backend (XLA reads XLA_FLAGS
once, at the first backend it creates); the CLIs call `apply_defaults` first thing.

On a GPU, XLA runs a `while` loop from the host: after each iteration it copies the predicate to
the host and waits, then launches the body's kernels one by one; a conditional does the same. A
decode call is such a loop (loop.py), with loops and conditionals inside its step (blocked
attention, adaptive k). With command buffers for WHILE and CONDITIONAL the loop runs inside CUDA
graphs: on an H200 (2026-12-04, docs/accelerators.md) a plain batch-1 step of the widened demo
went from 0.87 to 0.72 ms, the host's share per step from 938 to 215 us. So where a GPU will run,
`apply_defaults` adds COMMAND_BUFFERS to XLA_FLAGS. Opt out by naming the flag yourself: any
XLA_FLAGS that mentions `xla_gpu_enable_command_buffer` (`--xla_gpu_enable_command_buffer=` turns
command buffers off) is left as it is. The CPU gets nothing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import MutableMapping

COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
GPU_PLATFORMS = ("cuda", "gpu", "rocm")
GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def gpu_expected(env: MutableMapping[str, str]) -> bool:
  """Whether JAX will start on a GPU: JAX_PLATFORMS names one, or (unset) a GPU plugin is
  installed (JAX then prefers the GPU)."""
  platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms:
    return platforms[0] in GPU_PLATFORMS
  return any(importlib.util.find_spec(name) is not None for name in GPU_PLUGINS)


def xla_flags(env: MutableMapping[str, str]) -> str | None:
  """XLA_FLAGS with the GPU defaults added, or None where nothing changes (no GPU expected, or the
  user's XLA_FLAGS already names the command-buffer flag)."""
  flags = env.get("XLA_FLAGS", "")
  if "xla_gpu_enable_command_buffer" in flags or not gpu_expected(env):
    return None
  return f"{flags} {COMMAND_BUFFERS}".strip()


def apply_defaults(env: MutableMapping[str, str] = os.environ) -> bool:
  """Sets the GPU defaults in env's XLA_FLAGS. -> whether it changed them; False also where a JAX
  backend has already started (too late for XLA_FLAGS)."""
  if _backend_started():
    return False
  flags = xla_flags(env)
  if flags is None:
    return False
  env["XLA_FLAGS"] = flags
  return True


def _backend_started() -> bool:
  if "jax" not in sys.modules:
    return False
  bridge = sys.modules.get("jax._src.xla_bridge")
  return bool(getattr(bridge, "_backends", None))
