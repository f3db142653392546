"""The decode state's size: its bytes for a DecodeConfig, and the slots that fit a budget."""

from __future__ import annotations

import dataclasses

import jax

from mtp_jax.config import DecodeConfig, HeadsConfig, ModelConfig
from mtp_jax.decoding.engine import Engine  # the engine builds the state it sizes


def tree_bytes(tree) -> int:
  """Bytes of a pytree of arrays or shapes (PRNG keys, a few bytes each, are left out)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
                 if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)))


def state_bytes(model_cfg: ModelConfig, heads_cfg: HeadsConfig, decode_cfg: DecodeConfig,
                draft_model=None) -> int:
  """Bytes of the decode state (KV caches, token buffer, drafts, ring, ...) for decode_cfg."""
  eng = Engine(model_cfg, heads_cfg, decode_cfg, 0, draft_model)
  return tree_bytes(jax.eval_shape(eng.init_state))


def max_slots(model_cfg: ModelConfig, heads_cfg: HeadsConfig, decode_cfg: DecodeConfig,
              budget_bytes: int) -> int:
  """The largest slot count whose decode state fits budget_bytes (at least 1)."""
  one = state_bytes(model_cfg, heads_cfg, dataclasses.replace(decode_cfg, batch_size=1))
  two = state_bytes(model_cfg, heads_cfg, dataclasses.replace(decode_cfg, batch_size=2))
  per_slot, fixed = two - one, 2 * one - two
  return max(1, int((budget_bytes - fixed) // per_slot))
