"""Llama-style trunk (its blocks in layers.py) plus MTP heads (heads.py), in Flax NNX.

`MTPModel.__call__(tokens_BT, positions_BT, cache)` is the one forward pass used by training
(cache=None), prefill and verification. It returns the final (normed) hidden states, which the
heads read directly, and the updated cache. Positions of a row's T tokens are consecutive.

For jit, the engine and the trainer hold parameters as a pure dict {'trunk': ..., 'heads': ...}
and rebuild the module inside the traced function with `bind(graphdef, params)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import HeadsConfig, ModelConfig
from mtp_jax.models import cache as kv
from mtp_jax.models import heads as heads_lib
from mtp_jax.models.layers import Block, RMSNorm, compute_dtype, init_normal


class Trunk(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.embed_VD = nnx.Param(init_normal(1.0)(rngs.params(), (cfg.vocab_size, cfg.d_model), pd))
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    if not cfg.tie_embeddings:
      self.unembed_DV = nnx.Param(init_normal(cfg.d_model ** -0.5)(
          rngs.params(), (cfg.d_model, cfg.vocab_size), pd))

  def embed(self, tokens_BT):
    return jnp.take(self.embed_VD[...], tokens_BT, axis=0).astype(compute_dtype(self.cfg))

  def unembed(self, h_xD):
    """Logits in f32 for hidden states of any leading shape."""
    h = h_xD.astype(jnp.float32)
    if self.cfg.tie_embeddings:
      tied_DV = getattr(self, "tied_DV", None)     # set by `for_decoding`
      logits = (jnp.einsum("...D,VD->...V", h, self.embed_VD[...].astype(jnp.float32))
                if tied_DV is None else jnp.einsum("...D,DV->...V", h, tied_DV))
      # Native models: scale so that logits start at unit scale although embeddings have unit
      # variance.
      return logits * self.cfg.d_model ** -0.5 if self.cfg.tied_logits_scale else logits
    return jnp.einsum("...D,DV->...V", h, self.unembed_DV[...].astype(jnp.float32))

  def __call__(self, tokens_BT, pos_BT, cache: kv.KVCache | None = None, query_mask_TT=None,
               pre_norm: bool = False):
    """-> (final hidden states, after the final norm or with pre_norm before it; the updated
    cache)."""
    x = self.embed(tokens_BT)
    layers = []
    for i, block in enumerate(self.blocks):
      x, layer = block(x, pos_BT, None if cache is None else cache.layer(i),
                       query_mask_TT=query_mask_TT)
      layers.append(layer)
    return x if pre_norm else self.final_norm(x), None if cache is None else cache.with_layers(
        layers)


class MTPModel(nnx.Module):
  """The trunk and its multi-token heads."""

  def __init__(self, cfg: ModelConfig, heads_cfg: HeadsConfig, rngs: nnx.Rngs):
    self.cfg, self.heads_cfg = cfg, heads_cfg
    self.trunk = Trunk(cfg, rngs)
    self.heads = heads_lib.make_heads(cfg, heads_cfg, rngs)

  def __call__(self, tokens_BT, pos_BT, cache: kv.KVCache | None = None, query_mask_TT=None):
    """-> (the trunk's final hidden states h as the heads read them, the updated cache): after
    the final norm, or before it where heads.trunk_state='pre_norm' (MiMo); `logits(h)` takes
    either."""
    return self.trunk(tokens_BT, pos_BT, cache, query_mask_TT, self.pre_norm)

  @property
  def pre_norm(self) -> bool:
    return self.heads_cfg.trunk_state == "pre_norm"

  def logits(self, h_xD):
    """The trunk's logits (f32) of its hidden states h (from __call__)."""
    return self.trunk.unembed(self.trunk.final_norm(h_xD) if self.pre_norm else h_xD)

  def head_hidden(self, h_BTD, tokens_BW=None, n: int | None = None):
    """Hidden states of the first n heads (default all K), [B, T, n, D]. Sequential heads also
    read the tokens: tokens_BW[:, t + i] is module i's input at position t (W >= T + 1;
    missing ones are padded, so mask targets past the window)."""
    if self.heads_cfg.kind == "sequential":
      return self.heads(h_BTD, tokens_BW, self.trunk.embed)[:, :, :n]
    return self.heads(h_BTD, n)

  def head_unembed(self, x_xnD, head: int | None = None):
    """Logits [..., n, V] (f32) of the first n heads' hidden states (with `head`: logits
    [..., V] of that head's, x [..., D]): through the trunk's unembedding, or each head's own
    (heads.own_unembed)."""
    if not self.heads_cfg.own_unembed:
      return self.trunk.unembed(x_xnD)
    if head is None:
      return self.heads.unembed(x_xnD)
    return self.heads.unembed(x_xnD[..., None, :], head)[..., 0, :]

  def head_logits(self, h_BTD, tokens_BW=None):
    """Logits of all K heads, [B, T, K, V]: one unembedding matmul for all heads."""
    return self.head_unembed(self.head_hidden(h_BTD, tokens_BW))


def create(cfg: ModelConfig, heads_cfg: HeadsConfig, seed: int = 0) -> MTPModel:
  return MTPModel(cfg, heads_cfg, nnx.Rngs(params=seed))


def split(model: MTPModel):
  """-> (graphdef, params as a pure dict)."""
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def bind(graphdef, params) -> MTPModel:
  return nnx.merge(graphdef, params)


def unembed_copy(cfg: ModelConfig, params, rows: int):
  """-> the [D, V] copy of a tied embedding that decode calls unembed from, or None where they
  read the model as it is. rows: the rows of the calls' widest unembedding product
  (Engine.unembed_rows: slots times the tokens a step verifies a row). On XLA:CPU a product of
  several rows goes to a GEMM that repacks a transposed [V, D] right operand at every product (at
  Qwen2.5's vocabulary, 545 MB a product: a 3-draft step at one slot cost 3.2 plain steps reading
  [V, D], 1.9 from the copy; docs/benchmarks.md), so a tied model unembeds from a [D, V] copy;
  a product of one row is XLA:CPU's GEMV, which reads [V, D] as it lies, so plain decoding at
  one slot keeps it (and adaptive k at one slot, whose plain steps are products of one row).
  GPUs read either layout, and the copy would cost their memory. The engine makes the copy once
  per params (Engine.unembed) and hands it to every call: made inside each call, it cost about a
  plain step a call at 4 slots."""
  if cfg.tie_embeddings and rows > 1 and jax.default_backend() == "cpu":
    return _transposed(params["trunk"]["embed_VD"])
  return None


_transposed = jax.jit(lambda w_VD: jnp.transpose(w_VD.astype(jnp.float32)))


def for_decoding(m: MTPModel, unembed_DV=None) -> MTPModel:
  """The bound model a decode call runs: with unembed_DV (unembed_copy), a tied model unembeds
  from it."""
  if unembed_DV is not None:
    m.trunk.tied_DV = unembed_DV
  return m


def abstract(cfg: ModelConfig, heads_cfg: HeadsConfig):
  """-> (graphdef, params as ShapeDtypeStructs) without allocating anything."""
  abs_model = nnx.eval_shape(lambda: create(cfg, heads_cfg))
  graphdef, state = nnx.split(abs_model)
  return graphdef, nnx.to_pure_dict(state)


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
