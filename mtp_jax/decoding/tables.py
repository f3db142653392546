"""What adaptive k keeps on disk: the step costs a run learned (per device kind, model, slot
count and code: the next process's start, costs.py), the machine's roofs, the acceptance earlier
runs of a model saw (the controller's prior), and the summary of a finished run that feeds it.
One JSON file, default ~/.cache/mtp_jax/cost_tables.json ($XDG_CACHE_HOME respected).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.formats import cache_dir

# ----------------------------------------------------------------------------- a run's summaries


def run_rates(trials_K, hits_K, min_trials: int = 16) -> list[float]:
  """Per draft position, the conditional acceptance rate of a finished run from its counters
  (DecodeState.cond_trials / cond_hits): P(accept i | verified there with every draft before it
  accepted), -1 where fewer than min_trials such drafts were verified. (Drafts accepted / drafts
  verified per position would not do where k changed during the run: a later position is
  verified only in the run's steps that draft that far, its position before in every drafting
  step.) Host side; the next run's prior."""
  out = []
  for r, a in zip(np.asarray(trials_K, float), np.asarray(hits_K, float)):
    out.append(float(np.clip(a / r, 0.0, 1.0)) if r >= min_trials else -1.0)
  return out


# ----------------------------------------------------------------------------- the cost table


# The files a step's cost and its measurement depend on, relative to the package (this one
# included); a table measured by other code is stale.
_COST_FILES = ("decoding/adaptive.py", "models/attention.py", "models/cache.py",
               "decoding/engine.py", "decoding/loop.py", "models/layers.py", "models/model.py",
               "decoding/sampling.py", "decoding/ring.py", "decoding/step.py",
               "decoding/tree_verify.py", "decoding/costs.py")


def _code_version() -> str:
  """A hash of the sources in _COST_FILES and the drafters'."""
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  paths = [os.path.join(package, f) for f in _COST_FILES]
  folder = os.path.join(package, "decoding", "drafters")
  paths += [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".py")]
  h = hashlib.sha1()
  for path in paths:
    with open(path, "rb") as f:
      h.update(f.read())
  return h.hexdigest()[:8]


def runtime() -> str:
  """What else sets a step's cost on the same device kind: the jax version, the XLA flags, the
  devices and (on CPU) the cores this process may use. A table measured with one XLA thread is
  wrong for a run with two, and the reverse."""
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:            # not on Linux
    cores = os.cpu_count()
  flags = hashlib.sha1(os.environ.get("XLA_FLAGS", "").encode()).hexdigest()[:8]
  return f"jax={jax.__version__}|devices={jax.device_count()}|cores={cores}|xla_flags={flags}"


def table_key(engine) -> str:
  m, d = engine.model_cfg, engine.cfg
  dev = jax.devices()[0]
  model = hashlib.sha1(repr((m, engine.heads_cfg)).encode()).hexdigest()[:12]
  trees = hashlib.sha1(repr(d.adaptive_trees).encode()).hexdigest()[:8] if d.adaptive_trees \
      else "none"
  return f"{dev.platform}:{getattr(dev, 'device_kind', '')}|model={model}|slots={d.batch_size}" \
         f"|max_len={d.max_len}|k_max={engine.kd}|trees={trees}|adapt_every={d.adapt_every}" \
         f"|code={_code_version()}|{runtime()}"


def default_table_path() -> str:
  return os.path.join(cache_dir.root(), "cost_tables.json")


def load_entry(path: str, key: str):
  try:
    with open(path) as f:
      return json.load(f).get(key)
  except (OSError, json.JSONDecodeError, AttributeError):
    return None


def save_entry(path: str, key: str, entry: dict):
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  try:
    with open(path) as f:
      tables = json.load(f)
  except (OSError, json.JSONDecodeError):
    tables = {}
  if not isinstance(tables, dict):
    tables = {}
  tables[key] = {**entry, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    json.dump(tables, f, indent=2)
  os.replace(tmp, path)


def load_table(path: str, key: str, n: int):
  """-> the stored costs of n shapes (costs.CostModel.stored), or None."""
  entry = load_entry(path, key)
  try:
    ok = len(entry["cost_s"]) == n and all(float(c) > 0 for c in entry["cost_s"])
  except (KeyError, TypeError, ValueError):
    return None
  return entry if ok else None


def save_table(path: str, key: str, entry: dict):
  save_entry(path, key, entry)


# ----------------------------------------------------------------------------- stored acceptance


def params_fingerprint(params) -> str:
  """A short hash of the weights (each leaf's shape, dtype and the first 64 values of its first
  row): acceptance is a property of the trained heads, and two models of one config accept
  differently. Reads a few values per leaf, never a whole (possibly sharded) array."""
  h = hashlib.sha1()
  for leaf in jax.tree.leaves(params):
    leaf = jnp.asarray(leaf)
    on_cpu = all(d.platform == "cpu" for d in leaf.devices()) and leaf.is_fully_addressable
    if on_cpu:                       # the host's own memory: no device op per leaf
      leaf = np.asarray(leaf)
    row = leaf[(0,) * (leaf.ndim - 1)] if leaf.ndim else leaf[None]
    head = np.asarray(jax.device_get(row[:64]), np.float32)
    h.update(repr((leaf.shape, str(leaf.dtype))).encode())
    h.update(head.tobytes())
  return h.hexdigest()[:12]


def rates_key(engine, fingerprint: str, sampled: bool) -> str:
  """Key of a model's measured acceptance per draft position in the tables file: the weights,
  the drafter and K_max, greedy or sampled (rejection sampling accepts less), but not the
  device or the slot count (acceptance is the model's and the text's, not the machine's)."""
  # v2: from probes and drafting steps only (a plain step's check of the prefill's draft made
  # v1's entries of plainly decoded jobs far too low: step.py); v3: each rate with the
  # pseudo-trials it counts for (priors.py)
  return (f"acceptance-v3|weights={fingerprint}|drafter={engine.drafter}|k_max={engine.kd}"
          f"|{'sampled' if sampled else 'greedy'}")


def load_rates(path: str, key: str):
  """-> (the stored acceptance per draft position (-1 where unknown), the pseudo-trials each
  counts for), or None."""
  entry = load_entry(path, key)
  try:
    rates, trials = [float(x) for x in entry["rates"]], [float(x) for x in entry["trials"]]
  except (KeyError, TypeError, ValueError):
    return None
  return (rates, trials) if len(rates) == len(trials) else None


def save_rates(path: str, key: str, rates: list[float], trials: list[float]):
  """rates: the conditional acceptance per draft position (-1: unknown); trials: the
  pseudo-trials each counts for (priors.prior_trials)."""
  save_entry(path, key, {"rates": [round(float(r), 4) for r in rates],
                          "trials": [round(float(t), 1) for t in trials]})


def monotone(cost: list[float]) -> list[float]:
  """The closest non-decreasing sequence (pool adjacent violators): a step never costs less
  with more drafts, so a measured dip is noise, and averaging it with its neighbour keeps the
  controller from skipping over a k that merely measured high."""
  blocks = []                                     # [mean, count]
  for c in cost:
    blocks.append([c, 1])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
      blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
  return [m for m, n in blocks for _ in range(n)]
