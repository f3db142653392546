"""Plain greedy decoding with the cache equals re-running the full forward pass each step."""

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.models import model as M
from mtp_jax.training import generate as G
from tests.conftest import tiny_config

jax.config.update("jax_default_matmul_precision", "highest")


def test_greedy_with_cache_equals_uncached_argmax_loop():
  cfg = tiny_config(model={"dtype": "float32"})
  m = M.create(cfg.model, cfg.heads, seed=3)
  graphdef, params = M.split(m)
  rng = np.random.default_rng(0)
  lengths = [3, 9, 6]
  p, n = 9, 10
  prompt = np.zeros((3, p), np.int32)
  for b, l in enumerate(lengths):
    prompt[b, :l] = rng.integers(0, cfg.model.vocab_size, l)
  out = np.asarray(G.greedy_generate(graphdef, params, jnp.asarray(prompt),
                                     jnp.asarray(lengths, jnp.int32), n))
  width = p + n

  @jax.jit
  def next_token(params, seq_1W, t):
    """The full forward pass without a cache over the first t tokens (one compiled shape: a
    causal model's position t-1 does not see the padding after it), argmax."""
    model = M.bind(graphdef, params)
    h, _ = model(seq_1W, jnp.arange(width)[None])
    return jnp.argmax(model.logits(h[0, t - 1]))

  for b, l in enumerate(lengths):
    seq = np.zeros((1, width), np.int32)
    seq[0, :l] = prompt[b, :l]
    for t in range(l, l + n):
      seq[0, t] = int(next_token(params, jnp.asarray(seq), t))
    assert out[b, : l + n].tolist() == seq[0, : l + n].tolist()
