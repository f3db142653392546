"""The machine's roofs and a decode step's place under them.

Roofline: the machine's memory bandwidth (a matrix-vector product streaming a 512 MiB matrix, well
beyond the last-level cache: the access pattern of decoding; on an accelerator larger probes in
bf16, measure_roofs) and matmul throughput are measured in the same run. Per decode step the bytes
moved are the parameters plus the KV cache positions attention reads (dense: all max_len of
them; blocked: the blocks up to the longest row, averaged over the run: `kv_read_positions`), in
the cache's storage dtype (int8 adds an f32 scale per position and kv head), and the
FLOPs are 2 x multiply-adds of the k+1 verified tokens per row plus drafting; the attained FLOP
rate over the roof at the step's arithmetic intensity is `roofline_fraction`, and the step is
memory bound when its intensity is below the machine's ridge point (peak FLOP/s / bandwidth).
"""

from __future__ import annotations

import glob
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.config import DecodeConfig, ModelConfig
from mtp_jax.models import cache as kv_lib
from mtp_jax.models import model as model_lib


def _median_time(fn, *args, reps: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def measure_bandwidth(mib: int = 512) -> float:
  """Read bandwidth in bytes/s: a matrix-vector product over a `mib` MiB f32 matrix (beyond any
  last-level cache), the access pattern of a decode step that streams its weights."""
  cols = 16384
  w = jnp.ones((mib * 2**20 // 4 // cols, cols), jnp.float32)
  v = jnp.ones((cols,), jnp.float32)
  return w.nbytes / _median_time(jax.jit(lambda a, b: a @ b), w, v)


def measure_matmul(n: int = 2048, dtype=jnp.float32) -> float:
  """FLOP/s of an n x n x n matmul."""
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x: x @ x)
  return 2 * n**3 / _median_time(f, a)


def measure_roofs(platform: str, matmul_n: int = 2048) -> tuple[float, float]:
  """-> (read bandwidth bytes/s, matmul FLOP/s) in the regime a decode step runs in. A CPU
  computes in f32 (measure_bandwidth's matrix-vector product, a 2048^3 matmul). An accelerator
  computes in bf16 and needs work far larger than a CPU's to reach its roofs (on an H200 the CPU's
  probes read 1.2-1.9 TB/s and 31-75 TFLOP/s, well under its ~4.3 TB/s and bf16 rate): a
  streaming sum over 4 GiB, and an 8192^3 bf16 matmul; the better of the two bandwidth probes."""
  if platform == "cpu":
    return measure_bandwidth(), measure_matmul(matmul_n)
  x = jnp.ones((2**30,), jnp.float32)                     # 4 GiB
  stream = x.nbytes / _median_time(jax.jit(jnp.sum), x)
  del x
  return max(stream, measure_bandwidth(2048)), measure_matmul(8192, jnp.bfloat16)


def last_level_cache_bytes() -> int | None:
  """The CPU's last-level cache size (Linux sysfs), or None."""
  best = (0, None)
  for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
    try:
      level = int(open(os.path.join(d, "level")).read())
      size = open(os.path.join(d, "size")).read().strip()
    except (OSError, ValueError):
      continue
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
    num = int(size[:-1]) if size[-1:] in "KMG" else int(size)
    if level >= best[0]:
      best = (level, num * mult)
  return best[1]


def machine_info(roofline: bool = True) -> dict:
  dev = jax.devices()[0]
  info = {"platform": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
          "devices": jax.device_count(), "cpu_count": os.cpu_count(),
          "python": platform.python_version(), "jax": jax.__version__,
          "processor": platform.processor() or platform.machine()}
  if dev.platform == "cpu":
    info["last_level_cache_bytes"] = last_level_cache_bytes()
  if roofline:
    info.update(roofs(dev.platform))
  return info


def roofs(platform: str) -> dict:
  """The machine's measured roofs, as machine_info reports them."""
  bw, flops = measure_roofs(platform)
  return {"memory_bandwidth_gb_s": round(bw / 1e9, 2), "matmul_gflop_s": round(flops / 1e9, 2)}


def kv_read_positions(dcfg: DecodeConfig, prompt_len: int, new_tokens: int) -> float:
  """Cache positions a step's attention reads per row: all max_len (dense), or the blocks up to
  the longest row (blocked), averaged over a run whose rows grow from prompt_len by new_tokens."""
  if dcfg.attention == "dense":
    return float(dcfg.max_len)
  blk = min(dcfg.attention_block, dcfg.max_len)
  return float(np.mean([min(-(-(prompt_len + j) // blk) * blk, dcfg.max_len)
                        for j in range(max(new_tokens, 1))]))


def step_cost(mcfg: ModelConfig, hcfg, dcfg: DecodeConfig, k: float, batch: int, params,
              draft_params=None, draft_cfg: ModelConfig | None = None,
              kv_positions: float | None = None) -> tuple[float, float]:
  """(bytes, FLOPs) of one decode step with k drafts for `batch` rows (see the module doc);
  kv_positions: the cache positions attention reads per row (default all max_len), in the
  cache's storage dtype (a quantised one adds its f32 scale per position and kv head)."""
  itemsize = jnp.dtype(model_lib.compute_dtype(mcfg)).itemsize
  kv_item = kv_lib.storage_dtype(dcfg.kv_dtype, model_lib.compute_dtype(mcfg)).itemsize
  live = dcfg.max_len if kv_positions is None else kv_positions
  n_params = model_lib.count_params(params)
  head_params = model_lib.count_params(params["heads"]) if "heads" in params else 0
  kv_per_pos = 2 * mcfg.n_layers * mcfg.n_kv_heads * kv_lib.bytes_per_value(mcfg, kv_item)
  nbytes = (n_params - head_params) * itemsize + batch * live * kv_per_pos
  emb = mcfg.vocab_size * mcfg.d_model
  trunk_macs = n_params - head_params - (0 if mcfg.tie_embeddings else emb)  # untied: embed is a lookup
  attn_macs = 2 * mcfg.n_layers * mcfg.n_heads * mcfg.head_dim * live
  flops = 2 * batch * (k + 1) * (trunk_macs + attn_macs)
  if k and dcfg.drafter == "heads":
    nbytes += head_params * itemsize
    per_head = head_params / hcfg.num
    if hcfg.kind == "sequential":   # each module takes the step's k+1 tokens, then drafts once
      flops += 2 * batch * ((2 * k + 1) * per_head + k * emb)
    else:             # heads with their own unembedding hold it in per_head
      flops += 2 * batch * k * (per_head + (0 if hcfg.own_unembed else emb))
  if k and dcfg.drafter == "model" and draft_params is not None:
    dn = model_lib.count_params(draft_params)
    nbytes += dn * itemsize * k + batch * live * 2 * draft_cfg.n_layers * \
        draft_cfg.n_kv_heads * kv_lib.bytes_per_value(draft_cfg, kv_item)
    flops += 2 * batch * (k + 1) * dn
  return float(nbytes), float(flops)
