"""mtp-jax: speculative decoding with multi-token-prediction heads in JAX.

The public API, imported lazily (importing the package imports no JAX, so the CLIs check their
flags before JAX starts):

  import mtp_jax
  dec = mtp_jax.Decoder.load("pretrained/demo", batch_size=8, k="auto")
  for c in dec.generate(["def f(x):\\n"], max_new_tokens=64):
    print(c.text, c.acceptance_length)

The subpackages, each importing only from those before it and the top (config, sharding):
models (the network) < formats (files on disk) < decoding (the engine) < training < serving
(the Python API, the batch job) < bench (mtp-bench).
"""

from __future__ import annotations

import importlib

from mtp_jax.config import Config, ConfigError, DecodeConfig, HeadsConfig, ModelConfig

_LAZY = {
    "Decoder": "mtp_jax.serving.api",
    "Request": "mtp_jax.serving.api",
    "Completion": "mtp_jax.serving.api",
    "load_model_dir": "mtp_jax.formats.checkpoint",
    "save_model_dir": "mtp_jax.formats.checkpoint",
    "train": "mtp_jax.training.trainer",
}

__all__ = ["Completion", "Config", "ConfigError", "DecodeConfig", "Decoder", "HeadsConfig",
           "ModelConfig", "Request", "load_model_dir", "save_model_dir", "train"]


def __getattr__(name: str):
  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'mtp_jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(__all__))
