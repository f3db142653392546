"""The trunk: causality, and cached decoding equal to one full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.models import cache as kv
from mtp_jax.models import model as M
from tests.conftest import tiny_config

jax.config.update("jax_default_matmul_precision", "highest")


def _model(tie=True, seed=0):
  cfg = tiny_config(model={"tie_embeddings": tie, "dtype": "float32"})
  return cfg, M.create(cfg.model, cfg.heads, seed)


def _tokens(b, t, v, seed=1):
  return jnp.asarray(np.random.default_rng(seed).integers(0, v, (b, t)), jnp.int32)


def test_causality_later_tokens_do_not_change_earlier_hidden_states():
  cfg, m = _model()
  x = _tokens(2, 20, cfg.model.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(20), (2, 20))
  h1, _ = m(x, pos)
  x2 = x.at[:, 12:].set((x[:, 12:] + 7) % cfg.model.vocab_size)
  h2, _ = m(x2, pos)
  np.testing.assert_array_equal(np.asarray(h1[:, :12]), np.asarray(h2[:, :12]))
  assert not np.allclose(np.asarray(h1[:, 12:]), np.asarray(h2[:, 12:]))


def test_causality_by_gradient():
  """d h_t / d embedding(token_s) is zero for every s > t (nanodo's test); tokens are distinct
  so each embedding row belongs to one position."""
  cfg, m = _model()
  graphdef, params = M.split(m)
  t = 10
  x = (jnp.arange(t, dtype=jnp.int32) * 7 + 3)[None] % cfg.model.vocab_size
  pos = jnp.arange(t)[None]

  def h_at(embed, i):
    p = {**params, "trunk": {**params["trunk"], "embed_VD": embed}}
    return jnp.sum(M.bind(graphdef, p)(x, pos)[0][0, i])

  for i in (0, 4, 8):
    g = jax.grad(h_at)(params["trunk"]["embed_VD"], i)
    norms = np.asarray(jnp.linalg.norm(g[x[0]], axis=-1))
    assert np.all(norms[i + 1:] == 0), norms
    assert np.all(norms[: i + 1] > 0), norms


@pytest.mark.parametrize("tie", [True, False])
def test_cached_step_by_step_equals_full_forward(tie):
  cfg, m = _model(tie)
  b, t = 3, 24
  x = _tokens(b, t, cfg.model.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  full, _ = m(x, pos)
  cache = kv.init_cache(cfg.model, b, 32)
  # Prefill 7 tokens, then a 3-token chunk (as in verification), then one token at a time.
  h, cache = m(x[:, :7], pos[:, :7], cache)
  outs = [h]
  h, cache = m(x[:, 7:10], pos[:, 7:10], cache)
  outs.append(h)
  for i in range(10, t):
    h, cache = m(x[:, i:i + 1], pos[:, i:i + 1], cache)
    outs.append(h)
  cached = jnp.concatenate(outs, axis=1)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(full), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(m.logits(cached)), np.asarray(m.logits(full)),
                             atol=5e-5, rtol=5e-5)


def test_rows_at_different_positions_and_stale_entries_are_masked():
  """Each row decodes from its own length; garbage beyond a row's length is never attended to."""
  cfg, m = _model()
  v = cfg.model.vocab_size
  lengths = [5, 11, 8]
  rows = [_tokens(1, n + 1, v, seed=10 + n)[0] for n in lengths]
  cache = kv.init_cache(cfg.model, 3, 32)
  # Fill the whole cache with garbage first (as rejected drafts would leave it).
  junk = _tokens(3, 20, v, seed=99)
  _, cache = m(junk, jnp.broadcast_to(jnp.arange(20), (3, 20)), cache)
  # Write each row's prefix one token at a time at its own positions, then one step together.
  for b, n in enumerate(lengths):
    for p in range(n):
      tok = jnp.zeros((3, 1), jnp.int32).at[b, 0].set(rows[b][p])
      pos = jnp.array([[lengths[r] if r != b else p for r in range(3)]])[0][:, None]
      # other rows write at their (soon overwritten) next position
      _, cache = m(tok, pos, cache)
  step_tok = jnp.stack([rows[b][n] for b, n in enumerate(lengths)])[:, None]
  step_pos = jnp.array(lengths)[:, None]
  h, _ = m(step_tok, step_pos, cache)
  for b, n in enumerate(lengths):
    full, _ = m(rows[b][None, : n + 1], jnp.arange(n + 1)[None])
    np.testing.assert_allclose(np.asarray(h[b, 0]), np.asarray(full[0, n]), atol=2e-5, rtol=2e-5)


def test_gqa_shapes_and_param_count():
  cfg, m = _model()
  _, params = M.split(m)
  att = params["trunk"]["blocks"][0]["attn"]
  d, n, g, hd = (cfg.model.d_model, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.head_dim)
  assert att["wq_DNH"].shape == (d, n, hd) and att["wk_DGH"].shape == (d, g, hd)
  _, abstract = M.abstract(cfg.model, cfg.heads)
  assert M.count_params(abstract) == M.count_params(params)
  assert "unembed_DV" not in params["trunk"]


@pytest.mark.parametrize("tie", [True, False])
def test_decoding_view_gives_the_model_logits(tie):
  """unembed_copy / for_decoding (what a decode call binds): a tied model on CPU unembeds calls
  of several slots from a [D, V] copy, one slot's from the embedding itself; the logits are the
  model's."""
  cfg, m = _model(tie)
  graphdef, params = M.split(m)
  h = jax.random.normal(jax.random.key(3), (3, 4, cfg.model.d_model), jnp.float32)

  @jax.jit
  def run(params, copy_DV, h_xD):
    return (M.for_decoding(M.bind(graphdef, params), copy_DV).logits(h_xD),
            M.bind(graphdef, params).logits(h_xD))

  copy_DV = M.unembed_copy(cfg.model, params, 3)
  assert (copy_DV is not None) == (tie and jax.default_backend() == "cpu")
  view, model = run(params, copy_DV, h)
  np.testing.assert_allclose(np.asarray(view), np.asarray(model), atol=1e-5, rtol=1e-5)
  assert M.unembed_copy(cfg.model, params, 1) is None          # one slot: the same product
  view, model = run(params, None, h[:1, :1])
  np.testing.assert_array_equal(np.asarray(view), np.asarray(model))
