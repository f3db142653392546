"""Multi-token-prediction heads.

Head i (i = 1..K) maps the trunk's final hidden state h_t to a prediction of token t+1+i (the
trunk itself predicts t+1). Every kind exposes the same interface: `heads(h_BTD) -> [B, T, K, D]`
hidden states that go through the trunk's shared unembedding in one matmul.

'parallel' (Medusa / Gloeckle et al.): h + SiLU(h W_i + b_i), all K heads as one stacked weight
[K, D, D] and one einsum. W is initialised to zero, so every head starts as the identity, i.e. as a
copy of the trunk's next-token prediction, and training moves it one token further each. With
heads.layers = L > 1 each head stacks L such residual layers (Medusa's num_layers); with
heads.own_unembed each head predicts through its own [D, V] unembedding (Medusa-1's lm_head per
head, `unembed_KDV`) instead of the trunk's.

'sequential' (DeepSeek-V3 MTP modules): module i at position t computes
  x = W_h norm(h^{i-1}_t) + W_e norm(embed(token_{t+i}))      (= proj([norm(h); norm(e)]), 2D -> D)
  h^i_t = Block(x)  (attention over module i's own sequence + MLP),
and predicts token t+1+i through out_norm and the trunk's shared unembedding; h^0 is the trunk's
final hidden state. Module i runs at rotary position t + i (the position of its input token; only
relative positions matter), which is also where the decode engine keeps its K/V. W_h starts as the
identity and W_e at zero, so a fresh module starts close to the trunk's next-token prediction.
heads.module_d_ff narrows the blocks' MLP (a lighter module; the trunk's width by default).
heads.carry: module i+1 reads h^i as the block left it ('raw', DeepSeek-V3) or after out_norm
('normed', GLM-4.5 and MiMo). heads.trunk_state='pre_norm': h^0 is the trunk's residual stream
before its final norm (MiMo: then the trunk hands its state over before the norm and
`MTPModel.logits` applies it).
heads.zero_first_embed: module 1 reads a zero embedding at trunk position 0, as vLLM runs MiMo's
and DeepSeek's MTP layers (`first_embed_masked`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import HeadsConfig, ModelConfig
from mtp_jax.models.layers import Block, RMSNorm, init_normal


class ParallelHeads(nnx.Module):
  def __init__(self, cfg: ModelConfig, heads_cfg: HeadsConfig, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    k, d = heads_cfg.num, cfg.d_model
    self.w_KDE = nnx.Param(jnp.zeros((k, d, d), pd))
    self.b_KE = nnx.Param(jnp.zeros((k, d), pd))
    self.extra = heads_cfg.layers - 1
    if self.extra:                      # layers 2..L of every head
      self.wx_KLDE = nnx.Param(jnp.zeros((k, self.extra, d, d), pd))
      self.bx_KLE = nnx.Param(jnp.zeros((k, self.extra, d), pd))
    if heads_cfg.own_unembed:
      self.unembed_KDV = nnx.Param(init_normal(d ** -0.5)(rngs.params(), (k, d, cfg.vocab_size),
                                                          pd))

  def unembed(self, x_xnD, first: int = 0):
    """Logits [..., n, V] in f32 of heads first .. first+n-1's hidden states, each head through
    its own unembedding (heads.own_unembed)."""
    n = x_xnD.shape[-2]
    return jnp.einsum("...KD,KDV->...KV", x_xnD.astype(jnp.float32),
                      self.unembed_KDV[first: first + n].astype(jnp.float32))

  def __call__(self, h_BTD, n: int | None = None):
    """-> [B, T, n, D]: the first n heads (default all; a decode step that drafts fewer than
    K tokens computes only those)."""
    dt = h_BTD.dtype
    n = self.w_KDE.shape[0] if n is None else n
    # A product per head: one contraction over [n, D, E] makes XLA:CPU copy the heads' weights
    # to [D, n, E], every step.
    z = (jnp.stack([h_BTD @ self.w_KDE[i].astype(dt) for i in range(n)], 2)
         + self.b_KE[:n].astype(dt))
    x = h_BTD[:, :, None, :] + jax.nn.silu(z)
    for l in range(self.extra):
      z = (jnp.einsum("BTKD,KDE->BTKE", x, self.wx_KLDE[:n, l].astype(dt))
           + self.bx_KLE[:n, l].astype(dt))
      x = x + jax.nn.silu(z)
    return x


class MTPModule(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int = 0, carry: str = "raw"):
    """d_ff: the block's MLP width (0 = the trunk's); carry: heads.carry."""
    pd = jnp.dtype(cfg.param_dtype)
    d = cfg.d_model
    self.h_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.e_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.wh_DE = nnx.Param(jnp.eye(d, dtype=pd))
    self.we_DE = nnx.Param(jnp.zeros((d, d), pd))
    self.block = Block(dataclasses.replace(cfg, d_ff=d_ff or cfg.d_ff), rngs)
    self.out_norm = RMSNorm(d, cfg.norm_eps, pd)
    self.carry = carry

  def __call__(self, h_BTD, e_BTD, pos_BT, cache_kv=None, key_limit_B=None, key_min: int = 0):
    """-> (h^i as the next module reads it (heads.carry), h^i after out_norm: for the
    unembedding, the updated (k, v) of this module's cache). key_min: module i's cache starts
    at input position i (trunk position 0)."""
    dt = h_BTD.dtype
    x = (jnp.einsum("BTD,DE->BTE", self.h_norm(h_BTD), self.wh_DE[...].astype(dt))
         + jnp.einsum("BTD,DE->BTE", self.e_norm(e_BTD.astype(dt)), self.we_DE[...].astype(dt)))
    y, cache_kv = self.block(x, pos_BT, cache_kv, key_limit_B, key_min)
    yn = self.out_norm(y)
    return (yn if self.carry == "normed" else y), yn, cache_kv


def first_embed_masked(e_BTD, trunk_pos_BT, heads_cfg: HeadsConfig):
  """Module 1's input embeddings with heads.zero_first_embed applied (zero at trunk position
  0); pass them for module 1 only."""
  if not heads_cfg.zero_first_embed:
    return e_BTD
  return jnp.where((trunk_pos_BT == 0)[..., None], jnp.zeros((), e_BTD.dtype), e_BTD)


class SequentialHeads(nnx.Module):
  def __init__(self, cfg: ModelConfig, heads_cfg: HeadsConfig, rngs: nnx.Rngs):
    self.heads_cfg = heads_cfg
    self.modules = nnx.List([MTPModule(cfg, rngs, heads_cfg.module_d_ff, heads_cfg.carry)
                             for _ in range(heads_cfg.num)])

  def __call__(self, h_BTD, tokens_BW, embed):
    """Training / full recomputation: every module over the whole sequence -> [B, T, K, D]."""
    b, t, _ = h_BTD.shape
    k = len(self.modules)
    need = t + k
    if tokens_BW.shape[1] < need:
      tokens_BW = jnp.pad(tokens_BW, ((0, 0), (0, need - tokens_BW.shape[1])))
    outs, h = [], h_BTD
    for i, module in enumerate(self.modules, start=1):
      pos = jnp.broadcast_to(jnp.arange(t) + i, (b, t))
      e = embed(tokens_BW[:, i: i + t])
      if i == 1:
        e = first_embed_masked(e, pos - 1, self.heads_cfg)
      h, hn, _ = module(h, e, pos)
      outs.append(hn)
    return jnp.stack(outs, axis=2)


def make_heads(cfg: ModelConfig, heads_cfg: HeadsConfig, rngs: nnx.Rngs) -> nnx.Module:
  if heads_cfg.kind == "parallel":
    return ParallelHeads(cfg, heads_cfg, rngs)
  if heads_cfg.kind == "sequential":
    return SequentialHeads(cfg, heads_cfg, rngs)
  raise ValueError(f"heads.kind={heads_cfg.kind!r}: not implemented")
