"""Llama-style trunk (RMSNorm, RoPE, grouped-query attention, SwiGLU) plus MTP heads, in Flax NNX.

`MTPModel.__call__(tokens_BT, positions_BT, cache)` is the one forward pass used by training
(cache=None), prefill and verification. It returns the final (normed) hidden states, which the
heads read directly, and the updated cache. Positions of a row's T tokens are consecutive.

For jit, the engine and the trainer hold parameters as a pure dict {'trunk': ..., 'heads': ...}
and rebuild the module inside the traced function with `bind(graphdef, params)`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax import attention as attn_lib
from mtp_jax import cache as kv
from mtp_jax.config import HeadsConfig, ModelConfig


def compute_dtype(cfg: ModelConfig):
  if cfg.dtype != "auto":
    return jnp.dtype(cfg.dtype)
  # XLA:CPU bf16 matrix-vector products are far slower than f32 ones; see design.md.
  return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def _init(scale: float):
  return nnx.initializers.normal(stddev=scale)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, eps: float, param_dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies [H/2] of the rotary embedding, with the config's scaling (the formulas
  of the HF `rope_parameters` kinds, so that imported checkpoints see the same angles)."""
  h = cfg.head_dim
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float32) / h)
  kind, factor = cfg.rope_scaling, cfg.rope_factor
  if kind == "linear":
    inv = inv / factor
  elif kind == "llama3":
    old = cfg.rope_original_max_len
    low_wavelen, high_wavelen = old / cfg.rope_low_freq_factor, old / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    inv = np.where(medium, smoothed, scaled)
  elif kind == "yarn":
    def correction_dim(rotations):
      return h * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (
          2 * math.log(cfg.rope_theta))
    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, h - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(h // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv = (inv / factor) * (1 - extrapolate) + inv * extrapolate
  return inv.astype(np.float32)


def rope(x_BTnH, positions_BT, cfg: ModelConfig):
  """Rotary embedding (rotate-half form), computed in f32."""
  freq = jnp.asarray(rope_frequencies(cfg))
  angle_BTh = positions_BT[..., None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle_BTh)[:, :, None, :], jnp.cos(angle_BTh)[:, :, None, :]
  if cfg.rope_scaling == "yarn":
    sin, cos = sin * cfg.rope_attention_factor, cos * cfg.rope_attention_factor
  h = x_BTnH.shape[-1]
  x = x_BTnH.astype(jnp.float32)
  x1, x2 = x[..., : h // 2], x[..., h // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTnH.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, n, g, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    pd = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.wq_DNH = nnx.Param(_init(d ** -0.5)(rngs.params(), (d, n, h), pd))
    self.wk_DGH = nnx.Param(_init(d ** -0.5)(rngs.params(), (d, g, h), pd))
    self.wv_DGH = nnx.Param(_init(d ** -0.5)(rngs.params(), (d, g, h), pd))
    self.wo_NHD = nnx.Param(_init((n * h) ** -0.5 / (2 * cfg.n_layers) ** 0.5)(
        rngs.params(), (n, h, d), pd))
    if cfg.qkv_bias:
      self.bq_NH = nnx.Param(jnp.zeros((n, h), pd))
      self.bk_GH = nnx.Param(jnp.zeros((g, h), pd))
      self.bv_GH = nnx.Param(jnp.zeros((g, h), pd))
    if cfg.out_bias:
      self.bo_D = nnx.Param(jnp.zeros((d,), pd))

  def __call__(self, x_BTD, pos_BT, cache_kv=None, key_limit_B=None, key_min: int = 0,
               query_mask_TT=None):
    """cache_kv: this layer's cache, a kv.LayerKV or a (k, v) pair (float, read densely); the
    same kind comes back, updated. key_limit_B (with a cache): keys past this position are not
    attended to, except the query's own (the sequential heads' drafting skips entries not yet
    known to be right); key_min: cache positions below it hold nothing (a sequential module's
    first input); query_mask_TT: which of the step's own tokens each query attends (default
    causal; a tree's ancestor mask). See attention.py."""
    cfg, dt = self.cfg, x_BTD.dtype
    q = jnp.einsum("BTD,DNH->BTNH", x_BTD, self.wq_DNH[...].astype(dt))
    k = jnp.einsum("BTD,DGH->BTGH", x_BTD, self.wk_DGH[...].astype(dt))
    v = jnp.einsum("BTD,DGH->BTGH", x_BTD, self.wv_DGH[...].astype(dt))
    if cfg.qkv_bias:
      q = q + self.bq_NH[...].astype(dt)
      k = k + self.bk_GH[...].astype(dt)
      v = v + self.bv_GH[...].astype(dt)
    q, k = rope(q, pos_BT, cfg), rope(k, pos_BT, cfg)
    if cache_kv is None:
      m = attn_lib.mask(pos_BT, pos_BT, key_limit_B, key_min, query_mask_TT)
      return self._out(attn_lib.dense(q, k, v, m)), None
    layer = cache_kv if isinstance(cache_kv, kv.LayerKV) else kv.LayerKV(*cache_kv)
    layer = kv.write_layer(layer, k, v, pos_BT[:, 0])
    out = attn_lib.attend_cache(q, layer, pos_BT, key_limit_B, key_min, query_mask_TT)
    return self._out(out), layer if isinstance(cache_kv, kv.LayerKV) else (layer.k, layer.v)

  def _out(self, out_BTNH):
    # One contraction over N*H: contracting N and H apart lets XLA:CPU lay the attention
    # output out as [B, T, H, N] and transpose the whole weight to match, every step.
    b, t, n, h = out_BTNH.shape
    wo_ED = self.wo_NHD[...].astype(out_BTNH.dtype).reshape(n * h, -1)
    y = out_BTNH.reshape(b, t, n * h) @ wo_ED
    if self.cfg.out_bias:
      y = y + self.bo_D[...].astype(y.dtype)
    return y


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.d_ff
    pd = jnp.dtype(cfg.param_dtype)
    self.gate_DF = nnx.Param(_init(d ** -0.5)(rngs.params(), (d, f), pd))
    self.up_DF = nnx.Param(_init(d ** -0.5)(rngs.params(), (d, f), pd))
    self.down_FD = nnx.Param(_init(f ** -0.5 / (2 * cfg.n_layers) ** 0.5)(rngs.params(), (f, d), pd))

  def __call__(self, x_BTD):
    dt = x_BTD.dtype
    gate = jnp.einsum("BTD,DF->BTF", x_BTD, self.gate_DF[...].astype(dt))
    up = jnp.einsum("BTD,DF->BTF", x_BTD, self.up_DF[...].astype(dt))
    return jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate) * up, self.down_FD[...].astype(dt))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    self.mlp = MLP(cfg, rngs)

  def __call__(self, x_BTD, pos_BT, cache_kv=None, key_limit_B=None, key_min: int = 0,
               query_mask_TT=None):
    y, cache_kv = self.attn(self.attn_norm(x_BTD), pos_BT, cache_kv, key_limit_B, key_min,
                            query_mask_TT)
    x_BTD = x_BTD + y
    return x_BTD + self.mlp(self.mlp_norm(x_BTD)), cache_kv


class Trunk(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    pd = jnp.dtype(cfg.param_dtype)
    self.cfg = cfg
    self.embed_VD = nnx.Param(_init(1.0)(rngs.params(), (cfg.vocab_size, cfg.d_model), pd))
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pd)
    if not cfg.tie_embeddings:
      self.unembed_DV = nnx.Param(_init(cfg.d_model ** -0.5)(
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

  def __call__(self, tokens_BT, pos_BT, cache: kv.KVCache | None = None, query_mask_TT=None):
    """-> (final hidden states, the updated cache)."""
    x = self.embed(tokens_BT)
    layers = []
    for i, block in enumerate(self.blocks):
      x, layer = block(x, pos_BT, None if cache is None else cache.layer(i),
                       query_mask_TT=query_mask_TT)
      layers.append(layer)
    return self.final_norm(x), None if cache is None else cache.with_layers(layers)


class MTPModel(nnx.Module):
  """The trunk and its multi-token heads."""

  def __init__(self, cfg: ModelConfig, heads_cfg: HeadsConfig, rngs: nnx.Rngs):
    from mtp_jax import heads  # heads import model's building blocks
    self.cfg, self.heads_cfg = cfg, heads_cfg
    self.trunk = Trunk(cfg, rngs)
    self.heads = heads.make_heads(cfg, heads_cfg, rngs)

  def __call__(self, tokens_BT, pos_BT, cache: kv.KVCache | None = None, query_mask_TT=None):
    return self.trunk(tokens_BT, pos_BT, cache, query_mask_TT)

  def logits(self, h_xD):
    return self.trunk.unembed(h_xD)

  def head_hidden(self, h_BTD, tokens_BW=None, n: int | None = None):
    """Hidden states of the first n heads (default all K), [B, T, n, D]. Sequential heads also
    read the tokens: tokens_BW[:, t + i] is module i's input at position t (W >= T + 1;
    missing ones are padded, so mask targets past the window)."""
    if self.heads_cfg.kind == "sequential":
      return self.heads(h_BTD, tokens_BW, self.trunk.embed)[:, :, :n]
    return self.heads(h_BTD, n)

  def head_logits(self, h_BTD, tokens_BW=None):
    """Logits of all K heads, [B, T, K, V]: one unembedding matmul for all heads."""
    return self.trunk.unembed(self.head_hidden(h_BTD, tokens_BW))


def create(cfg: ModelConfig, heads_cfg: HeadsConfig, seed: int = 0) -> MTPModel:
  return MTPModel(cfg, heads_cfg, nnx.Rngs(params=seed))


def split(model: MTPModel):
  """-> (graphdef, params as a pure dict)."""
  graphdef, state = nnx.split(model)
  return graphdef, nnx.to_pure_dict(state)


def bind(graphdef, params) -> MTPModel:
  return nnx.merge(graphdef, params)


def unembed_copy(cfg: ModelConfig, params, rows: int):
  """-> the [D, V] copy of a tied embedding that decode calls of `rows` slots unembed from, or
  None where they read the model as it is. On XLA:CPU, with two slots or more, a tied model
  unembeds from a [D, V] copy: XLA:CPU's GEMM repacks a transposed [V, D] right operand at every
  product of several rows (at the demo's size, 4096 x 256, a product of 4 rows took 147 us
  against 83 us from the copy; docs/decoding.md, The tied unembedding on CPU). A product of one
  row is XLA:CPU's GEMV, which reads [V, D] as it lies; one slot keeps it, as a call reading both
  layouts reads twice the bytes (one slot's steps of one draft ran 11% slower so). GPUs read
  either layout, and the copy would cost their memory. The engine makes the copy once per params
  (Engine.unembed) and hands it to every call: made inside each call, it cost about a plain step
  a call at 4 slots."""
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
