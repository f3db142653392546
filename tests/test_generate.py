"""Plain greedy decoding with the cache equals re-running the full forward pass each step."""

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import generate as G
from mtp_jax import model as M
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
  for b, l in enumerate(lengths):
    seq = list(prompt[b, :l])
    for _ in range(n):
      h, _ = m(jnp.asarray([seq]), jnp.arange(len(seq))[None])
      seq.append(int(jnp.argmax(m.logits(h[0, -1]))))
    assert out[b, : l + n].tolist() == seq
