"""The widened model computes the original's function: same logits (f32 tolerance), same greedy
tokens, for tied and untied embeddings, biases, parallel and sequential heads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.bench import widen
from mtp_jax.config import HeadsConfig, ModelConfig
from mtp_jax.models import model as M
from mtp_jax.training import generate as G


def _random_model(mcfg, hcfg, seed=0):
  """A tiny model with every parameter random (heads start as the identity otherwise, which
  would hide a wrong split of their weights)."""
  graphdef, params = M.split(M.create(mcfg, hcfg, seed))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return graphdef, jax.tree.unflatten(tree, leaves)


def _outputs(mcfg, hcfg, params, tokens_BT):
  graphdef, _ = M.abstract(mcfg, hcfg)
  m = M.bind(graphdef, params)
  pos = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
  h, _ = m(tokens_BT, pos)
  return np.asarray(m.logits(h)), np.asarray(m.head_logits(h, tokens_BT)), graphdef


CASES = {
    "tied": (dict(), dict()),
    "untied_bias": (dict(tie_embeddings=False, qkv_bias=True, out_bias=True), dict(layers=2)),
    "sequential": (dict(), dict(kind="sequential", num=2, module_d_ff=96)),
}


# n = 3: the split weights are not exact (w / 3), so rounding is exercised too.
@pytest.mark.parametrize("case, n", [("tied", 3), ("untied_bias", 2), ("sequential", 2)])
def test_widened_model_keeps_logits_and_greedy_tokens(case, n):
  mfields, hfields = CASES[case]
  mcfg = dataclasses.replace(ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4,
                                         n_kv_heads=2, d_ff=48, max_seq_len=64, dtype="float32"),
                             **mfields)
  hcfg = dataclasses.replace(HeadsConfig(num=3), **hfields)
  _, params = _random_model(mcfg, hcfg)
  mcfg2, hcfg2, params2 = widen.widen_params(mcfg, hcfg, params, n)
  assert mcfg2.d_model == n * mcfg.d_model and mcfg2.n_kv_heads == n * mcfg.n_kv_heads
  assert M.count_params(params2) > (n * n - 1) * M.count_params(params["trunk"]["blocks"])

  tokens = jax.random.randint(jax.random.key(3), (2, 24), 0, mcfg.vocab_size)
  logits, head_logits, graphdef = _outputs(mcfg, hcfg, params, tokens)
  logits2, head_logits2, graphdef2 = _outputs(mcfg2, hcfg2, params2, tokens)
  scale = np.abs(logits).max()
  np.testing.assert_allclose(logits2, logits, atol=2e-5 * scale, rtol=0)
  np.testing.assert_allclose(head_logits2, head_logits, atol=2e-5 * np.abs(head_logits).max(),
                             rtol=0)

  prompt = tokens[:, :8].astype(jnp.int32)
  lengths = jnp.asarray([8, 5], jnp.int32)
  a = np.asarray(G.greedy_generate(graphdef, params, prompt, lengths, 20))
  b = np.asarray(G.greedy_generate(graphdef2, params2, prompt, lengths, 20))
  np.testing.assert_array_equal(a, b)


def test_spec_parsing():
  assert widen.parse_spec("widen:4:pretrained/demo") == (4, "pretrained/demo")
  for bad in ("widen:0:x", "widen:x:y", "widen:4"):
    with pytest.raises(ValueError):
      widen.parse_spec(bad)
