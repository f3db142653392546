"""Multi-token-prediction heads.

Head i (i = 1..K) maps the trunk's final hidden state h_t to a prediction of token t+1+i (the
trunk itself predicts t+1). Every kind exposes the same interface: `heads(h_BTD) -> [B, T, K, D]`
hidden states that go through the trunk's shared unembedding in one matmul.

'parallel' (Medusa / Gloeckle et al.): h + SiLU(h W_i + b_i), all K heads as one stacked weight
[K, D, D] and one einsum. W is initialised to zero, so every head starts as the identity, i.e. as a
copy of the trunk's next-token prediction, and training moves it one token further each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import HeadsConfig, ModelConfig


class ParallelHeads(nnx.Module):
  def __init__(self, cfg: ModelConfig, heads_cfg: HeadsConfig, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    k, d = heads_cfg.num, cfg.d_model
    self.w_KDE = nnx.Param(jnp.zeros((k, d, d), pd))
    self.b_KE = nnx.Param(jnp.zeros((k, d), pd))

  def __call__(self, h_BTD):
    dt = h_BTD.dtype
    z = jnp.einsum("BTD,KDE->BTKE", h_BTD, self.w_KDE[...].astype(dt)) + self.b_KE[...].astype(dt)
    return h_BTD[:, :, None, :] + jax.nn.silu(z)


def make_heads(cfg: ModelConfig, heads_cfg: HeadsConfig, rngs: nnx.Rngs) -> nnx.Module:
  if heads_cfg.kind == "parallel":
    return ParallelHeads(cfg, heads_cfg, rngs)
  raise ValueError(f"heads.kind={heads_cfg.kind!r}: not implemented")
