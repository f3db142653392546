"""One trunk forward of a decode step, dense vs blocked attention, by cache length (docs/attention.md).

  python tools/attention_bench.py [MODEL_DIR]

Rows sit at position LIVE (a 64-token prompt plus 32 new tokens); the cache holds S positions.
Prints the median milliseconds of the jitted forward (T = 1: plain decoding; T = 4: three drafts
verified) for each batch, S, kv dtype and attention.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp_jax.formats import checkpoint as ckpt_lib  # noqa: E402
from mtp_jax.models import cache as kv  # noqa: E402
from mtp_jax.models import model as M  # noqa: E402

LIVE = 96


def time_step(mcfg, graphdef, params, b, s, t, attention, kv_dtype, reps=15):
  @jax.jit
  def f(params, x, pos, cache):
    h, cache = M.bind(graphdef, params)(x, pos, cache)
    return h, cache
  cache = kv.init_cache(mcfg, b, s, jnp.dtype(kv_dtype), attention, 128)
  x = jnp.zeros((b, t), jnp.int32)
  pos = jnp.broadcast_to(LIVE + jnp.arange(t), (b, t))
  jax.block_until_ready(f(params, x, pos, cache))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(params, x, pos, cache))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))


def main():
  mcfg, hcfg, params, _ = ckpt_lib.load_model_dir(sys.argv[1] if len(sys.argv) > 1
                                                  else "pretrained/demo")
  graphdef, _ = M.abstract(mcfg, hcfg)
  print("| batch | T | S | kv | dense ms | blocked ms | dense / blocked |\n|---|---|---|---|---|---|---|")
  for b in (16, 64):
    for t in (1, 4):
      for s in (128, 256, 1024):
        for kv_dtype in ("float32", "int8"):
          d = time_step(mcfg, graphdef, params, b, s, t, "dense", kv_dtype)
          bl = time_step(mcfg, graphdef, params, b, s, t, "blocked", kv_dtype)
          print(f"| {b} | {t} | {s} | {kv_dtype} | {d:.2f} | {bl:.2f} | {d / bl:.2f} |",
                flush=True)


if __name__ == "__main__":
  main()
