"""What adaptive k keeps on disk and measures on the host: the cost table c(k) (per device kind,
model, slot count and code), the acceptance earlier runs of a model saw (the controller's
prior), and the summary of a finished run that feeds it. One JSON file,
default ~/.cache/mtp_jax/cost_tables.json ($XDG_CACHE_HOME respected).
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.decoding import adaptive
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
               "decoding/tree_verify.py", "decoding/tables.py")


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


def _runtime() -> str:
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
         f"|code={_code_version()}|{_runtime()}"


def default_table_path() -> str:
  return os.path.join(cache_dir.root(), "cost_tables.json")


def _load_entry(path: str, key: str):
  try:
    with open(path) as f:
      return json.load(f).get(key)
  except (OSError, json.JSONDecodeError, AttributeError):
    return None


def _save_entry(path: str, key: str, entry: dict):
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


def load_table(path: str, key: str):
  entry = _load_entry(path, key)
  return None if entry is None else [float(x) for x in entry["cost_s"]]


def save_table(path: str, key: str, cost: list[float], **info):
  _save_entry(path, key, {"cost_s": cost, **info})


# ----------------------------------------------------------------------------- stored acceptance


def params_fingerprint(params) -> str:
  """A short hash of the weights (each leaf's shape, dtype and the first 64 values of its first
  row): acceptance is a property of the trained heads, and two models of one config accept
  differently. Reads a few values per leaf, never a whole (possibly sharded) array."""
  h = hashlib.sha1()
  for leaf in jax.tree.leaves(params):
    leaf = jnp.asarray(leaf)
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
  entry = _load_entry(path, key)
  try:
    rates, trials = [float(x) for x in entry["rates"]], [float(x) for x in entry["trials"]]
  except (KeyError, TypeError, ValueError):
    return None
  return (rates, trials) if len(rates) == len(trials) else None


def save_rates(path: str, key: str, rates: list[float], trials: list[float]):
  """rates: the conditional acceptance per draft position (-1: unknown); trials: the
  pseudo-trials each counts for (priors.prior_trials)."""
  _save_entry(path, key, {"rates": [round(float(r), 4) for r in rates],
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


def measure_costs(engine, params, rel_err: float = 0.02, budget_s: float = 60.0,
                  min_rounds: int = 10, max_rounds: int = 400, steps: int = 32):
  """Seconds per step with k = 0..K_max drafts (then each of adaptive k's trees: index k > K_max
  of engine.shape), every slot active: warm, `steps` steps per
  run, every k once per round (in alternating order). The controller only weighs costs against
  each other, so c(k) is the median over rounds of c(k) / c(0) within the round (a slow spell
  of a shared machine slows a whole round alike) times the median c(0); rows start from random
  prompts of calibration_length tokens, so that they sit about the cache's middle; made
  non-decreasing in k (see monotone). One run's time on a shared machine is off by several
  percent, and a table off by 8% in c(3) / c(1) turns the controller to the wrong k: rounds go
  on until the standard error of every ratio is below rel_err, or budget_s has passed (after
  min_rounds).
  A tree that could not be chosen even at a cost two standard errors below its estimate
  (ShapeSet.viable at the model's rates) is measured no further: its precision changes nothing,
  and where a step of T+1 tokens costs far more than one (XLA:CPU) the trees would take most of
  every round.
  -> (cost [K+1], {"rounds", "rel_se": the largest standard error of a ratio still measured,
  "dropped": the trees no longer measured})."""
  b, k1 = engine.cfg.batch_size, engine.n_shapes
  steps = min(steps, engine.cfg.ring_size)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(0, engine.model_cfg.vocab_size, calibration_length(engine, steps)))
             for _ in range(b)]
  prefix = engine.prefill(params, prompts, jax.random.key(0), [0.0] * b, [0] * b, [1.0] * b)

  def one(k):
    state = engine.insert(prefix, engine.init_state(), list(range(b)), engine.cfg.max_len,
                          0.0, 0, 1.0)
    state = engine.put(state, k_force=k)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = engine.generate(params, state, steps, sample=False)
    ran = int(state.record.step)
    return (time.perf_counter() - t0) / max(ran, 1)

  for k in range(k1):                                # compiles / warms up
    one(k)
  rows, se, start, live = [], float("inf"), time.perf_counter(), list(range(k1))
  while len(rows) < max_rounds:
    row = [float("nan")] * k1
    for k in (live if len(rows) % 2 == 0 else live[::-1]):
      row[k] = one(k)
    rows.append(row)
    n = len(rows)
    if n >= min_rounds:
      if n >= 2:
        t = np.asarray(rows)                                     # [rounds, shapes]
        lr = np.log(t[:, 1:] / t[:, :1])
        # of a median; 0 for an engine without drafts (nothing to weigh against c(0))
        se_S = 1.2533 * np.nanstd(lr, axis=0, ddof=1) / np.sqrt(np.sum(~np.isnan(lr), 0))
        keep = _still_viable(engine, t, se_S)
        live = [k for k in live if k <= engine.kd or k in keep]
        se = float(np.max(se_S[np.asarray(live[1:], int) - 1], initial=0.0))
      if se < rel_err or time.perf_counter() - start > budget_s:
        break
  t = np.asarray(rows).T                                         # [shapes, rounds]
  cost = [float(np.median(t[0]) * np.nanmedian(t[k] / t[0])) for k in range(k1)]
  cost = monotone(cost[:engine.kd + 1]) + cost[engine.kd + 1:]       # chains, then trees
  return cost, {"rounds": len(rows), "rel_se": round(se, 4),
                "dropped": [k for k in range(engine.kd + 1, k1) if k not in live]}


def calibration_length(engine, steps: int) -> int:
  """The prompt length the cost table is timed from: rows then sit about the middle of the
  cache over the timed steps (random tokens: about one token a step), where a run's rows sit on
  average, since blocked attention reads the live positions and a step of k drafts attends k + 1
  queries, so c(k) / c(0) grows with the context (16 slots, demo model, 210 positions: c(2) /
  c(0) 2.10 from 8 tokens, 2.20-2.38 from 96)."""
  cap = engine.cfg.max_len - engine.span - 1
  return int(max(8, min(engine.cfg.max_len // 2 - steps // 2, cap)))


def _still_viable(engine, t, se_S) -> tuple[int, ...]:
  """The trees that ShapeSet.viable keeps at costs two standard errors below their estimates
  (the chains' at their estimates), from the rounds so far t [rounds, shapes]."""
  ratio = np.nanmedian(t / t[:, :1], axis=0)
  kd, margin = engine.kd, engine.cfg.adapt_margin
  low = np.concatenate([ratio[:kd + 1], ratio[kd + 1:] * np.exp(-2.0 * se_S[kd:])])
  chains = adaptive.viable_ks(monotone(list(ratio[:kd + 1])), margin)
  return engine.shape_set.viable(low, chains, margin)
