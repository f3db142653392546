"""What an int8 (or fp8) KV cache costs in quality, on held-out code (docs/attention.md).

  python tools/kv_quality.py [MODEL_DIR] [KV_DTYPE]

1. Greedy decoding: N prompts of 64 tokens, 128 new tokens, plain decoding with a float32 cache
   and with KV_DTYPE: how many outputs are identical, and where the others first differ.
2. Teacher forcing: held-out pieces of 512 tokens run through the trunk with each cache (every
   token attends to the cache's stored K/V, its own included, as in decoding): mean NLL and
   perplexity per token.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp_jax.bench import benchmark  # noqa: E402
from mtp_jax.config import DecodeConfig  # noqa: E402
from mtp_jax.formats import checkpoint as ckpt_lib  # noqa: E402
from mtp_jax.models import cache as kv  # noqa: E402
from mtp_jax.models import model as M  # noqa: E402
from mtp_jax.serving import api  # noqa: E402

N_PROMPTS, NEW, PIECES, PIECE = 48, 128, 16, 512


def greedy(mcfg, hcfg, params, tok, prompts, kv_dtype):
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=16, k=0, kv_dtype=kv_dtype,
                                                          max_len=64 + NEW + 8))
  return [o.token_ids for o in dec.run([api.Request(p, NEW) for p in prompts])]


def nll(mcfg, hcfg, params, pieces, kv_dtype):
  graphdef, _ = M.abstract(mcfg, hcfg)

  @jax.jit
  def f(params, x):
    m = M.bind(graphdef, params)
    b, t = x.shape
    cache = kv.init_cache(mcfg, b, t, jnp.dtype(kv_dtype), "dense")
    h, _ = m(x, jnp.broadcast_to(jnp.arange(t), (b, t)), cache)
    logp = jax.nn.log_softmax(m.logits(h[:, :-1]), -1)
    return -jnp.take_along_axis(logp, x[:, 1:, None], -1)[..., 0]
  return float(np.mean(np.concatenate([np.asarray(f(params, jnp.asarray(pieces[i: i + 4])))
                                       for i in range(0, len(pieces), 4)])))


def main():
  model_dir = sys.argv[1] if len(sys.argv) > 1 else "pretrained/demo"
  kv_dtype = sys.argv[2] if len(sys.argv) > 2 else "int8"
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(model_dir)
  prompts = benchmark.heldout_prompts(tok, N_PROMPTS, 64, seed=123)
  ref, got = (greedy(mcfg, hcfg, params, tok, prompts, d) for d in ("float32", kv_dtype))
  same = sum(a == b for a, b in zip(ref, got))
  first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
           for a, b in zip(ref, got) if a != b]
  agree = np.mean([np.mean([x == y for x, y in zip(a, b)]) for a, b in zip(ref, got)])
  print(f"greedy, {N_PROMPTS} held-out prompts x {NEW} tokens: {same}/{N_PROMPTS} identical "
        f"with {kv_dtype}; the others first differ at tokens {sorted(first)}; "
        f"position-wise agreement {agree:.3f}")
  pieces = np.asarray(benchmark.heldout_prompts(tok, PIECES, PIECE, seed=321), np.int32)
  base, q = nll(mcfg, hcfg, params, pieces, "float32"), nll(mcfg, hcfg, params, pieces, kv_dtype)
  print(f"teacher forcing, {PIECES} x {PIECE} held-out tokens: NLL float32 {base:.5f} "
        f"(ppl {np.exp(base):.3f}), {kv_dtype} {q:.5f} (ppl {np.exp(q):.3f}), "
        f"ppl change {100 * (np.exp(q - base) - 1):+.3f}%")


if __name__ == "__main__":
  main()
