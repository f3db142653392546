"""Parallel MTP heads: one stacked weight, identity at init, one unembedding for all heads."""

import jax.numpy as jnp
import numpy as np

from mtp_jax import model as M
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
