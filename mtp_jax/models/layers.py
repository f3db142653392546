"""The trunk's building blocks (Llama-style, in Flax NNX): RMSNorm, RoPE, grouped-query attention
over a KV cache, SwiGLU MLP, the pre-norm block. The trunk (model.py) stacks them; sequential MTP
modules (heads.py) reuse the block."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.models import attention as attn_lib
from mtp_jax.models import cache as kv


def compute_dtype(cfg: ModelConfig):
  if cfg.dtype != "auto":
    return jnp.dtype(cfg.dtype)
  # XLA:CPU bf16 matrix-vector products are far slower than f32 ones; see design.md.
  return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def init_normal(scale: float):
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
    self.wq_DNH = nnx.Param(init_normal(d ** -0.5)(rngs.params(), (d, n, h), pd))
    self.wk_DGH = nnx.Param(init_normal(d ** -0.5)(rngs.params(), (d, g, h), pd))
    self.wv_DGH = nnx.Param(init_normal(d ** -0.5)(rngs.params(), (d, g, h), pd))
    self.wo_NHD = nnx.Param(init_normal((n * h) ** -0.5 / (2 * cfg.n_layers) ** 0.5)(
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
    self.gate_DF = nnx.Param(init_normal(d ** -0.5)(rngs.params(), (d, f), pd))
    self.up_DF = nnx.Param(init_normal(d ** -0.5)(rngs.params(), (d, f), pd))
    self.down_FD = nnx.Param(init_normal(f ** -0.5 / (2 * cfg.n_layers) ** 0.5)(
        rngs.params(), (f, d), pd))

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
