"""Decode attention: blocked == dense, masks (rows at different lengths, block boundaries, tree
masks, the sequential modules' key_min / key_limit), the int8 cache, and the engine with both."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import DecodeConfig
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.models import attention as A
from mtp_jax.models import cache as kv
from mtp_jax.models import model as M
from mtp_jax.serving import api
from tests.conftest import tiny_config
from tests.helpers import assert_same_distribution, compiles, heldout_prompts

jax.config.update("jax_default_matmul_precision", "highest")

B, S, G, R, H = 4, 44, 2, 2, 16       # S not a multiple of the block: the last block overlaps


def _layer(dtype=jnp.float32, block=8, seed=0):
  rng = np.random.default_rng(seed)
  k = jnp.asarray(rng.normal(size=(B, S, G, H)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, S, G, H)), jnp.float32)
  layer = kv.init_cache(tiny_config(model={"n_kv_heads": G, "n_heads": G * R,
                                           "d_model": G * R * H}).model,
                        B, S, dtype, "blocked", block).layer(0)
  return kv.write_layer(layer, k, v, jnp.zeros((B,), jnp.int32))


def _q(t, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(B, t, G * R, H)), jnp.float32)


def _both(q, layer, pos, **kw):
  dense = A.attend_cache(q, layer, pos, impl="dense", **kw)
  blocked = A.attend_cache(q, layer, pos, impl="blocked", **kw)
  return np.asarray(dense), np.asarray(blocked)


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("block", [8, 16, 64])
def test_blocked_equals_dense_for_rows_at_different_lengths(t, block):
  """Row starts put the furthest key at a block's end (15 -> 2 blocks exactly), one past it
  (16), in the overlapping last block (S - t: the cache's end) and at position 0."""
  layer = _layer(block=block)
  start = jnp.asarray([16 - t, 17 - t, S - t, 0])
  pos = start[:, None] + jnp.arange(t)[None]
  dense, blocked = _both(_q(t), layer, pos)
  np.testing.assert_allclose(blocked, dense, atol=1e-5, rtol=1e-5)


def test_the_loop_reads_only_the_blocks_up_to_the_longest_row():
  pos = jnp.asarray([[3], [15], [7], [0]])
  assert int(A.n_blocks(pos, S, 8)) == 2
  assert int(A.n_blocks(pos + 1, S, 8)) == 3
  assert int(A.n_blocks(jnp.full((4, 1), S - 1), S, 8)) == 6
  # Keys past the furthest row are never read: garbage there (even NaN) changes nothing.
  layer = _layer()
  nan = layer.replace(k=layer.k.at[:, 16:].set(jnp.nan), v=layer.v.at[:, 16:].set(jnp.nan))
  pos = jnp.asarray([[12, 13, 14, 15]] * B)
  out = A.attend_cache(_q(4), nan, pos, impl="blocked")
  np.testing.assert_allclose(np.asarray(out), _both(_q(4), layer, pos)[0], atol=1e-5)


def test_custom_query_mask():
  """A tree step: query 3 attends tokens 0 and 3 only, query 2 tokens 0, 1, 2; both
  implementations agree with a mask built by hand, and with the mask, keys in the history
  stay visible."""
  t = 4
  qm = jnp.asarray([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], bool)
  layer = _layer()
  start = jnp.asarray([5, 20, 9, 30])
  pos = start[:, None] + jnp.asarray([0, 1, 2, 1])[None]     # rotary positions: depths
  dense, blocked = _both(_q(t), layer, pos, query_mask_TT=qm)
  np.testing.assert_allclose(blocked, dense, atol=1e-5, rtol=1e-5)
  hand = np.zeros((B, t, S), bool)
  for b in range(B):
    s0 = int(start[b])
    hand[b, :, :s0] = True
    hand[b, :, s0: s0 + t] = np.asarray(qm)
  ref = A.dense(_q(t), layer.k, layer.v, jnp.asarray(hand))
  np.testing.assert_allclose(dense, np.asarray(ref), atol=1e-6)


def test_sequential_modules_key_min_and_key_limit():
  layer = _layer()
  pos = jnp.asarray([[9], [17], [30], [3]])
  limit = jnp.asarray([4, 15, 16, 1])
  dense, blocked = _both(_q(1), layer, pos, key_limit_B=limit, key_min=2)
  np.testing.assert_allclose(blocked, dense, atol=1e-5, rtol=1e-5)
  # Prefill-like: every position of a row, the first ones below key_min (no key at all: the
  # blocked loop gives zeros there, dense an average of masked keys; neither is read).
  pos = jnp.broadcast_to(jnp.arange(24), (B, 24))
  dense, blocked = _both(_q(24), layer, pos, key_min=2)
  np.testing.assert_allclose(blocked[:, 2:], dense[:, 2:], atol=1e-5, rtol=1e-5)
  assert np.all(np.isfinite(blocked))


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_quantised_cache(dtype):
  """Dequantised entries are within the storage's step of the float ones; blocked == dense on
  the quantised cache; attention moves by little."""
  f = _layer()
  q8 = _layer(jnp.dtype(dtype))
  assert q8.k.dtype == jnp.dtype(dtype) and q8.k_scale.shape == (B, S, G)
  deq = np.asarray(kv.dequantize(q8.k, q8.k_scale, jnp.float32))
  amax = np.abs(np.asarray(f.k)).max(-1, keepdims=True)
  rel = 1 / 127 if dtype == "int8" else 1 / 8        # e4m3: 3 mantissa bits
  assert np.all(np.abs(deq - np.asarray(f.k)) <= amax * rel * 0.51 + 1e-6)
  pos = jnp.asarray([[12, 13, 14, 15]] * B) + jnp.asarray([0, 3, 20, 28])[:, None]
  dense, blocked = _both(_q(4), q8, pos)
  np.testing.assert_allclose(blocked, dense, atol=1e-5, rtol=1e-5)
  exact, _ = _both(_q(4), f, pos)
  assert np.abs(dense - exact).max() < (0.05 if dtype == "int8" else 0.3)


@pytest.mark.parametrize("attention, dtype, tol", [("blocked", "float32", 2e-5),
                                                   ("blocked", "int8", 0.05),
                                                   ("dense", "int8", 0.05)])
def test_model_cached_steps_equal_the_full_forward(attention, dtype, tol):
  cfg = tiny_config(model={"dtype": "float32"})
  m = M.create(cfg.model, cfg.heads, 0)
  b, t = 3, 40
  x = jnp.asarray(np.random.default_rng(1).integers(0, cfg.model.vocab_size, (b, t)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  full, _ = m(x, pos)
  cache = kv.init_cache(cfg.model, b, 48, jnp.dtype(dtype), attention, 16)
  h, cache = m(x[:, :15], pos[:, :15], cache)            # prefill ends one before a boundary
  outs = [h]
  h, cache = m(x[:, 15:19], pos[:, 15:19], cache)        # a k+1 = 4 chunk across it
  outs.append(h)
  for i in range(19, t):
    h, cache = m(x[:, i:i + 1], pos[:, i:i + 1], cache)
    outs.append(h)
  assert cache.k[0].dtype == jnp.dtype(dtype)
  np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full),
                             atol=tol, rtol=tol)


@pytest.mark.parametrize("attention", ["dense", "blocked"])
def test_model_tree_step_with_an_ancestor_mask(attention):
  """Tokens [a, b, c] where c is b's sibling (depth 1, mask row [1, 0, 1]): c's hidden state
  equals that of the chain [a, c]."""
  cfg = tiny_config(model={"dtype": "float32"})
  m = M.create(cfg.model, cfg.heads, 0)
  x = jnp.asarray(np.random.default_rng(2).integers(0, 512, (2, 20)), jnp.int32)
  cache = kv.init_cache(cfg.model, 2, 32, jnp.float32, attention, 8)
  _, cache = m(x[:, :14], jnp.broadcast_to(jnp.arange(14), (2, 14)), cache)
  qm = jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
  tree_pos = jnp.broadcast_to(jnp.asarray([14, 15, 15]), (2, 3))
  h_tree, _ = m(x[:, 14:17], tree_pos, cache, query_mask_TT=qm)
  chain = jnp.stack([x[:, 14], x[:, 16]], 1)
  h_chain, _ = m(chain, jnp.broadcast_to(jnp.asarray([14, 15]), (2, 2)), cache)
  np.testing.assert_allclose(np.asarray(h_tree[:, 2]), np.asarray(h_chain[:, 1]), atol=2e-5)
  np.testing.assert_allclose(np.asarray(h_tree[:, 0]), np.asarray(h_chain[:, 0]), atol=2e-5)


# ----------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def tiny_model(trained_tiny):
  cfg, workdir, _ = trained_tiny
  return ckpt_lib.load_model_dir(os.path.join(workdir, "model")), cfg


def _dec(tiny, **decode):
  (mcfg, hcfg, params, tok), _ = tiny
  return api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(**decode))


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_greedy_speculative_equals_plain_with_blocked_attention(tiny_model, kv_dtype):
  (_, _, _, tok), cfg = tiny_model
  prompts = heldout_prompts(cfg, tok, 6, seed=11)
  reqs = [api.Request(p, n) for p, n in zip(prompts, [40, 7, 60, 33, 50, 21])]
  common = dict(batch_size=3, ring_size=8, kv_dtype=kv_dtype, attention="blocked",
                attention_block=16)
  plain = _dec(tiny_model, k=0, **common).run(reqs)
  spec_dec = _dec(tiny_model, k=3, **common)
  spec = spec_dec.run(reqs)
  assert [r.token_ids for r in plain] == [r.token_ids for r in spec]
  assert sum(spec_dec.last_stats["accepted"]) > 0
  # And dense attention over the same cache dtype gives the same tokens.
  dense = _dec(tiny_model, k=0, **{**common, "attention": "dense"}).run(reqs)
  assert [r.token_ids for r in plain] == [r.token_ids for r in dense]


def test_sampling_is_lossless_with_int8_and_blocked(tiny_model):
  """The 2nd and 3rd generated tokens (made by draft-and-verify steps) follow the same
  distribution with k = 3 as with plain sampling, on an int8 cache read in blocks; chi-square
  test of homogeneity as in test_engine, failing below p = 1e-4."""
  (_, _, _, tok), cfg = tiny_model
  prompt = heldout_prompts(cfg, tok, 1, seed=3)[0][:12]
  common = dict(batch_size=64, ring_size=8, kv_dtype="int8", attention="blocked",
                attention_block=8)
  def draw(k, seed0):
    dec = _dec(tiny_model, k=k, **common)
    out = dec.run([api.Request(prompt, 3, 1.0, 4, seed=seed0 + i) for i in range(1024)])
    return [",".join(map(str, o.token_ids[1:3])) for o in out], dec.last_stats
  plain, _ = draw(0, 0)
  spec, st = draw(3, 10_000)
  assert sum(st["accepted"]) > 0.1 * sum(st["drafted"]), st
  assert_same_distribution(plain, spec)


def test_no_recompilation_as_rows_grow_across_blocks(tiny_model):
  (_, _, _, tok), cfg = tiny_model
  dec = _dec(tiny_model, batch_size=2, k=3, ring_size=8, attention="blocked", attention_block=8,
             kv_dtype="int8")
  prompts = heldout_prompts(cfg, tok, 4, seed=5)
  dec.warmup(max_prompt_len=32)
  with compiles() as compiled:
    dec.run([api.Request(prompts[0][:5], 3), api.Request(prompts[1][:30], 60)])
    dec.run([api.Request(prompts[2][:9], 70, 1.0, 4), api.Request(prompts[3][:3], 20)])
  assert compiled == [], compiled
