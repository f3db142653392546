"""Parallel MTP heads: one stacked weight, identity at init, one unembedding for all heads."""

import jax.numpy as jnp
import numpy as np

from mtp_jax.models import model as M
from tests.conftest import tiny_config


def test_heads_start_as_identity_of_the_trunk_prediction():
  cfg = tiny_config()
  m = M.create(cfg.model, cfg.heads)
  x = jnp.arange(12, dtype=jnp.int32)[None] % cfg.model.vocab_size
  h, _ = m(x, jnp.arange(12)[None])
  hl = m.head_logits(h)
  assert hl.shape == (1, 12, cfg.heads.num, cfg.model.vocab_size)
  for i in range(cfg.heads.num):
    np.testing.assert_allclose(np.asarray(hl[:, :, i]), np.asarray(m.logits(h)), atol=1e-6)


def test_heads_are_one_stacked_weight_and_differ_after_perturbation():
  cfg = tiny_config()
  m = M.create(cfg.model, cfg.heads)
  _, params = M.split(m)
  k, d = cfg.heads.num, cfg.model.d_model
  assert params["heads"]["w_KDE"].shape == (k, d, d)
  assert params["heads"]["b_KE"].shape == (k, d)
  m.heads.w_KDE[...] = jnp.asarray(np.random.default_rng(0).normal(size=(k, d, d)), jnp.float32)
  h, _ = m(jnp.arange(6, dtype=jnp.int32)[None], jnp.arange(6)[None])
  hl = np.asarray(m.head_logits(h))
  assert not np.allclose(hl[:, :, 0], hl[:, :, 1])
  # Each head's slice equals the head computed on its own.
  z = jnp.einsum("BTD,DE->BTE", h, m.heads.w_KDE[1]) + m.heads.b_KE[1]
  own = m.logits(h + jnp.asarray(__import__("jax").nn.silu(z)))
  np.testing.assert_allclose(hl[:, :, 1], np.asarray(own), atol=1e-4)


def test_deeper_heads_stack_residual_layers_and_start_as_identity():
  """heads.layers = 3: every head is h -> h + SiLU(h W + b), three times, on its own weights."""
  import jax
  cfg = tiny_config(heads={"layers": 3})
  m = M.create(cfg.model, cfg.heads)
  _, params = M.split(m)
  k, d = cfg.heads.num, cfg.model.d_model
  assert params["heads"]["wx_KLDE"].shape == (k, 2, d, d)
  assert params["heads"]["bx_KLE"].shape == (k, 2, d)
  h, _ = m(jnp.arange(6, dtype=jnp.int32)[None], jnp.arange(6)[None])
  for i in range(k):         # zero-initialised: still the identity
    np.testing.assert_allclose(np.asarray(m.head_logits(h)[:, :, i]), np.asarray(m.logits(h)),
                               atol=1e-6)
  rng = np.random.default_rng(1)
  m.heads.w_KDE[...] = jnp.asarray(rng.normal(size=(k, d, d)) * 0.1, jnp.float32)
  m.heads.wx_KLDE[...] = jnp.asarray(rng.normal(size=(k, 2, d, d)) * 0.1, jnp.float32)
  m.heads.bx_KLE[...] = jnp.asarray(rng.normal(size=(k, 2, d)) * 0.1, jnp.float32)
  hh = np.asarray(m.head_hidden(h))
  x = h + jax.nn.silu(jnp.einsum("BTD,DE->BTE", h, m.heads.w_KDE[2]) + m.heads.b_KE[2])
  for layer in range(2):
    x = x + jax.nn.silu(jnp.einsum("BTD,DE->BTE", x, m.heads.wx_KLDE[2, layer])
                        + m.heads.bx_KLE[2, layer])
  np.testing.assert_allclose(hh[:, :, 2], np.asarray(x), atol=1e-5)
