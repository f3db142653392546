"""Unrolled vs scanned layers at Qwen2.5-0.5B's shape: compile time, program size and step time of
the trunk's decode forward over a dense f32 KV cache (T = 1: a plain step, T = 4: verifying 3
drafts), the blocks as model.py runs them (docs/benchmarks.md, Real shapes).

  python tools/scan_layers.py [N_LAYERS]
"""
import sys, time, dataclasses
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from mtp_jax import config as config_lib
from mtp_jax.models.layers import Block
from configs import qwen2_5_0_5b

cfg = config_lib.Config.from_dict(qwen2_5_0_5b.get_config().to_dict()).model
L = int(sys.argv[1]) if len(sys.argv) > 1 else cfg.n_layers
cfg = dataclasses.replace(cfg, n_layers=L)
S = 256
block = Block(cfg, nnx.Rngs(0))
gdef, p0 = nnx.split(block)
p0 = nnx.to_pure_dict(p0)
layers = [jax.tree.map(lambda x, i=i: x + 0.001 * i, p0) for i in range(L)]
stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
G, H = cfg.n_kv_heads, cfg.head_dim
k_L = jnp.zeros((L, 1, S, G, H)); v_L = jnp.zeros((L, 1, S, G, H))

def unrolled(layers, k_L, v_L, x, pos):
  ks, vs = [], []
  for i in range(L):
    x, (k, v) = nnx.merge(gdef, layers[i])(x, pos, (k_L[i], v_L[i]))
    ks.append(k); vs.append(v)
  return x, jnp.stack(ks), jnp.stack(vs)

def scanned(stacked, k_L, v_L, x, pos):
  def body(x, lkv):
    lp, k, v = lkv
    x, (k, v) = nnx.merge(gdef, lp)(x, pos, (k, v))
    return x, (k, v)
  x, (k, v) = jax.lax.scan(body, x, (stacked, k_L, v_L))
  return x, k, v

def timed(f, *a, reps=15):
  jax.block_until_ready(f(*a)); ts = []
  for _ in range(reps):
    t = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t)
  return np.median(ts) * 1e3

for T in (1, 4):
  x = jax.random.normal(jax.random.key(0), (1, T, cfg.d_model))
  pos = (100 + jnp.arange(T))[None]
  row = []
  for name, f, p in (("unrolled", unrolled, layers), ("scanned", scanned, stacked)):
    jf = jax.jit(f, donate_argnums=())
    t0 = time.perf_counter(); comp = jf.lower(p, k_L, v_L, x, pos).compile(); tc = time.perf_counter() - t0
    size = len(comp.as_text())
    row.append(f"{name}: compile {tc:.1f} s, HLO {size/1e3:.0f} kB, step {timed(comp, p, k_L, v_L, x, pos):.1f} ms")
  print(f"L={L} T={T}: " + "; ".join(row), flush=True)
