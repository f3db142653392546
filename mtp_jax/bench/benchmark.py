"""Decoding benchmark: modes x batch sizes on the same prompts, measured side by side.

Modes: 'vanilla' (plain decoding, k = 0), 'mtp:K' (K drafts from the MTP heads per step),
'adaptive' (k chosen on the device from the step costs learned while decoding and acceptance), 'draft:K'
(classic speculative decoding: K drafts from a separate small draft model with its own KV cache)
and 'ngram:K' (prompt lookup: K drafts copied from the row's own history), 'tree:T' (a token tree
of T nodes from the heads' top candidates, verified in one pass: shapes.tree_for), 'control'
(plain decoding again, in a decoder of its own: its speedup, which would be 1.00 on a quiet
machine, is how far two decoders of one program differ in this process, an offset that repeats
do not remove, so the floor below which the other speedups say nothing). All go through the same
verification, so greedy outputs are identical. Every (batch size, mode) pair gets its own
compiled engine (compile time reported apart), warmed up before timing; timed runs of all modes
are interleaved repeat by repeat, so that a noisy machine slows all of them alike, in reversed
order every other repeat, so that no mode always runs first or right after another. A row is the
mode's repeat of median throughput; its speedup is the median over repeats of the throughput ratio
to vanilla's throughput at the moment the run ran, interpolated between the vanilla runs before
and after it (interquartile range in brackets in the table): the alternating order puts every run
between two vanilla runs, so a machine whose speed drifts steadily cancels out. An adaptive row is
also set against the best fixed shape beside it (vanilla, mtp:K, tree:T) by the same pairing: a
second table, adaptive / best fixed (compare_to_best_fixed).

Latency: a request's time to first token (TTFT) is from the start of the run to the moment the
host holds its first token; its time per output token (TPOT) is (finish - first token) / (tokens
- 1), the finish being when the host drained the chunk holding its last token. Host overhead per
decode step: the run's wall time minus the time the host spent blocked waiting for the device
(prefill results and drained chunks), divided by the decode steps run; it is the host work on
the critical path (dispatch, detokenising, refilling), in microseconds.

Roofline (decoding/roofline.py): bytes and FLOPs per step against the machine's measured roofs.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import sharding as sharding_lib
from mtp_jax.bench import widen as widen_lib
from mtp_jax.bench.modes import parse_mode
from mtp_jax.bench.prompts import heldout_prompts, load_prompts  # noqa: F401 (API)
from mtp_jax.bench.report import (  # noqa: F401 (API)
  HEADER,
  Result,
  format_row,
  format_tables,
  format_vs_best,
  write_outputs,
)
from mtp_jax.decoding.roofline import kv_read_positions, machine_info, roofs, step_cost  # noqa: F401 (API)
from mtp_jax.config import Config, DecodeConfig
from mtp_jax.decoding import memory, shape_set, shapes
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.models import model as model_lib
from mtp_jax.serving import api
from mtp_jax.training import data as data_lib


def _model_dir(model: str) -> str | None:
  """The model directory a --model spec reads trees.json from (none for config:NAME)."""
  model_dir = model.split(":", 2)[-1] if model.startswith("widen:") else model
  return model_dir if os.path.isdir(model_dir) else None


def _tree(k, num_heads: int, model: str):
  """A 'tree:T' mode's tree (k from parse_mode; the model directory's, else the default)."""
  budget = shapes.tree_budget(k)
  if budget is None:
    return None
  return shapes.tree_for(budget, num_heads, _model_dir(model))


# ----------------------------------------------------------------------------- models


def load_model(spec: str, seed: int = 0):
  """A model directory, 'config:NAME': an untrained model of configs/NAME.py (random weights,
  fine for speed; a tokenizer of at most 4,096 tokens trained on a little of the corpus stands in
  for the real one: ids past it decode to nothing), or 'widen:N:DIR': DIR's
  model widened N times by a function-preserving expansion (its tokens and acceptance, N^2 times
  the bytes; mtp_jax/widen.py)."""
  if spec.startswith("widen:"):
    return widen_lib.load_widened(spec)
  if not spec.startswith("config:"):
    return ckpt_lib.load_model_dir(spec)
  name = spec[len("config:"):]
  try:
    mod = importlib.import_module(f"configs.{name}")
  except ImportError:
    raise ValueError(f"--model={spec}: no configs/{name}.py") from None
  cfg = Config.from_dict(mod.get_config().to_dict())
  from mtp_jax.formats.tokenizer import train_bpe
  files, _ = data_lib.split_files(cfg.data)
  tok = train_bpe(data_lib.iter_texts(cfg.data, files, 2_000_000),
                  min(cfg.model.vocab_size, 4096))
  _, params = model_lib.split(model_lib.create(cfg.model, cfg.heads, seed))
  dtype = model_lib.compute_dtype(cfg.model)
  params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, params)
  return cfg.model, cfg.heads, params, tok


# ----------------------------------------------------------------------------- the run


def run(model: str, modes: list[str], batch_sizes: list[int], max_new_tokens: int,
        prompt_tokens: int = 64, rounds: int = 1, repeats: int = 2, warmup: int = 1,
        temperature: float = 0.0, prompts: str = "", draft_model: str = "",
        machine: dict | None = None, log=print, cost_table: str | None = None,
        mesh: str | None = None, attention=DecodeConfig.attention,
        kv_dtype=DecodeConfig.kv_dtype, max_len: int = 0, progress=None,
        top_p: float = 1.0) -> list[Result]:
  """mesh: a mesh shape ('data:2,model:4') to decode on; None = one device. progress(done,
  total, what): called after each mode's compile and each timed run (total: all of them).
  attention, kv_dtype: one value, or several: then every mode runs once per combination, side
  by side, labelled 'mode attention kv_dtype'; speedups are to the first combination's vanilla."""
  variants = _variants(modes, attention, kv_dtype)
  done, total = 0, len(batch_sizes) * len(variants) * (1 + repeats)
  tick = progress or (lambda *a: None)
  mcfg, hcfg, params, tok = load_model(model)
  device_mesh = None if mesh is None else sharding_lib.make_mesh(mesh)
  draft = None
  if any(parse_mode(m)[0] == "model" for m in modes):
    if not draft_model:
      raise ValueError("draft:K modes need --draft_model")
    dm, dh, dp, dtok = ckpt_lib.load_model_dir(draft_model)
    if dtok.hf.to_str() != tok.hf.to_str():
      raise ValueError(f"--draft_model={draft_model}: its tokenizer differs from the model's")
    draft = (dm, dh, dp)
  results = []
  for b in batch_sizes:
    ids = load_prompts(prompts, tok, b * rounds, prompt_tokens, seed=b)
    reqs = [api.Request(p, max_new_tokens, temperature=temperature, top_p=top_p, seed=i)
            for i, p in enumerate(ids)]
    longest = max(len(p) for p in ids)
    decoders, compile_s = {}, {}
    for label, variant in variants.items():
      decoders[label], compile_s[label] = _decoder(
          model, mcfg, hcfg, params, tok, draft, device_mesh, variant, b, longest,
          max_new_tokens, max_len, cost_table, log if b == batch_sizes[0] else None)
      for _ in range(warmup):
        decoders[label].run(reqs[:b])                     # host-side helpers warmed too
        compile_s[label] += _settle(decoders[label])
      done += 1
      tick(done, total, f"batch {b} {label}: compiled in {compile_s[label]:.0f}s")
    runs = {m: [] for m in variants}
    labels = list(variants)
    t_first = time.perf_counter()
    for rep in range(repeats):
      for mode in (labels if rep % 2 == 0 else labels[::-1]):
        r = _timed(decoders[mode], reqs, mode, b, compile_s[mode], t_first)
        compile_s[mode] += _settle(decoders[mode])
        runs[mode].append(r)
        done += 1
        tick(done, total, f"batch {b} {mode}: {r.tokens_per_s:,.0f} tokens/s, acceptance "
             f"{r.acceptance_length:.2f}")
    base = next((runs[m] for m, v in variants.items() if v[0] == "vanilla"), None)
    rows = {mode: summarize(runs[mode], base) for mode in labels}
    compare_to_best_fixed(rows, runs, variants)
    for mode, r in rows.items():
      _roofline(r, decoders[mode], mcfg, hcfg, params, draft, machine,
                kv_read_positions(decoders[mode].engine.cfg, longest, max_new_tokens))
      results.append(r)
      log(format_row(r))
  return results


def _decoder(model, mcfg, hcfg, params, tok, draft, device_mesh, variant, b, longest,
             max_new_tokens, max_len, cost_table, log):
  """One (mode, attention, kv_dtype) variant's decoder at b slots, with its cost table where adaptive
  and warmed up. log: where to describe its mesh layout (None: not again). -> (decoder,
  seconds to compile)."""
  mode, attention, kv_dtype = variant
  drafter, k = parse_mode(mode)
  tree = _tree(k, hcfg.num, model)
  auto = (shape_set.auto_options(hcfg, _model_dir(model), {"drafter": drafter})
          if k == "auto" else {})
  span = max([hcfg.num if k == "auto" else k if tree is None else tree.size]
             + [len(t) for t in auto.get("adaptive_trees", ())])      # a step's inputs
  # By default the cache holds what a row can reach; --max_len sets a serving-sized one.
  cache_len = max_len or min(mcfg.max_seq_len, longest + max_new_tokens + span + 2)
  dcfg = DecodeConfig(batch_size=b, k=-1 if k == "auto" or tree is not None else k,
                      ring_size=32, adaptive=k == "auto", max_len=cache_len,
                      drafter=drafter, attention=attention, kv_dtype=kv_dtype,
                      tree=() if tree is None else tree.choices, **auto)
  dec = api.Decoder(mcfg, hcfg, params, tok, dcfg,
                    draft=draft if drafter == "model" else None, mesh=device_mesh)
  if device_mesh is not None and log is not None:
    log(f"{mode}: mesh {dict(device_mesh.shape)}, per device: params "
        f"{sharding_lib.bytes_per_device(dec.params) / 2**20:.1f} MiB, decode state "
        f"{sharding_lib.bytes_per_device(dec.engine.init_state()) / 2**20:.1f} MiB")
  t0 = time.perf_counter()
  if k == "auto":
    dec.cost_table(cost_table)
  dec.warmup(longest)
  return dec, time.perf_counter() - t0


def _settle(dec) -> float:
  """Waits for the programs adaptive k compiles behind its runs (programs.py), so that no
  compile slows another mode's timed run. -> the seconds waited (counted as compile time)."""
  t0 = time.perf_counter()
  if dec.engine.programs is not None:
    dec.engine.programs.wait()
  return time.perf_counter() - t0


def _timed(dec, reqs, mode: str, b: int, compile_s: float, t_first: float) -> Result:
  """One timed run of every request: throughput, latencies, counts, host time and memory."""
  t0 = time.perf_counter()
  outs = dec.run(reqs)
  dt = time.perf_counter() - t0
  n = sum(len(o.token_ids) for o in outs)
  st, tm = dec.last_stats, dec.last_timing
  ttft = np.array([o.ttft_s for o in outs]) * 1e3
  tpot = np.array([(o.latency_s - o.ttft_s) / max(len(o.token_ids) - 1, 1)
                   for o in outs]) * 1e3
  state_bytes = memory.tree_bytes(jax.eval_shape(dec.engine.init_state))
  stats = jax.devices()[0].memory_stats() or {}
  return Result(
      mode, b, n / dt, st["acceptance_length"], st["acceptance_rate_per_position"], n, dt,
      st["steps"], float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99)),
      float(np.percentile(tpot, 50)), float(np.percentile(tpot, 99)),
      (tm["wall_s"] - tm["wait_s"]) / max(st["steps"], 1) * 1e6, compile_s,
      memory.tree_bytes(dec.params) + state_bytes, stats.get("peak_bytes_in_use"),
      at_s=t0 + dt / 2 - t_first,
      reused_from=1 if dec.engine.cfg.reuse_module else 0)


def _variants(modes, attention, kv_dtype) -> dict[str, tuple[str, str, str]]:
  """-> {label: (mode, attention, kv_dtype)}: each mode per attention and cache dtype given (a
  string or a list), the combinations in the order given; labels name what varies."""
  attns = [attention] if isinstance(attention, str) else list(attention)
  kvs = [kv_dtype] if isinstance(kv_dtype, str) else list(kv_dtype)
  out = {}
  for a in attns:
    for kv in kvs:
      for mode in modes:
        varied = ([a] if len(attns) > 1 else []) + ([kv] if len(kvs) > 1 else [])
        out[" ".join([mode] + varied)] = (mode, a, kv)
  return out


def summarize(runs: list[Result], base: list[Result] | None) -> Result:
  """One row from a mode's timed repeats: the repeat of median throughput (its latencies and
  counts with it), and the speedup as the median over repeats of the ratio of a run's
  throughput to vanilla's at the same moment (paired_ratios), with its interquartile range; the
  step cost likewise, of its seconds per decode step (what a step of the mode costs in plain
  steps, whatever its drafts' acceptance: the measure for random weights)."""
  r = dataclasses.replace(sorted(runs, key=lambda x: x.tokens_per_s)[(len(runs) - 1) // 2])
  if base:
    r.speedup, r.speedup_q25, r.speedup_q75 = _quartiles(paired_ratios(runs, base))
    r.step_cost = _quartiles(paired_ratios(runs, base, _step_s))[0]
  return r


def _step_s(r: Result) -> float:
  """A run's seconds per decode step (its prefills included)."""
  return r.seconds / max(r.steps, 1)


def paired_ratios(runs: list[Result], base: list[Result], key=None) -> np.ndarray:
  """Per run, its throughput (or key(run)) over base's at the moment it ran (at_s): base's is
  interpolated
  linearly in time between its runs before and after (the nearest one past either end); runs
  without times (at_s all equal) pair with base's run of the same repeat. Ratios to the moment
  follow a machine whose speed drifts between repeats: in the alternating order a mode runs up to
  len(modes) - 1 runs away from the same repeat's base run, but always between two of base's
  runs. A ratio of the best runs compares two lucky moments."""
  key = key or (lambda r: r.tokens_per_s)
  at = np.array([v.at_s for v in base])
  if len(base) > 1 and np.all(np.diff(at) > 0):
    tps = np.array([key(v) for v in base])
    return np.array([key(x) / np.interp(x.at_s, at, tps) for x in runs])
  return np.array([key(x) / key(v) for x, v in zip(runs, base)])


def _quartiles(ratios: np.ndarray) -> tuple[float, float, float]:
  """-> (median, first quartile, third quartile)."""
  return tuple(float(q) for q in np.quantile(ratios, [0.5, 0.25, 0.75]))


def compare_to_best_fixed(rows: dict[str, Result], runs: dict[str, list[Result]],
                          variants: dict[str, tuple[str, str, str]]):
  """Sets each adaptive row's best_fixed and vs_best: the fixed shape of the heads (vanilla,
  mtp:K, tree:T) of highest speedup at the same attention and cache dtype, and the median over
  repeats of adaptive's throughput over that mode's at the same moment (paired_ratios), with its
  interquartile range: adaptive k's promise (at or above plain decoding; near the best fixed k)
  read off one run, pairs of runs side by side."""
  for label, (mode, attention, kv) in variants.items():
    if mode != "adaptive":
      continue
    fixed = [lb for lb, (m, a, c) in variants.items() if (a, c) == (attention, kv)
             and parse_mode(m)[0] == "heads" and m not in ("adaptive", "control")]
    if not fixed:
      continue
    best = max(fixed, key=lambda lb: (rows[lb].speedup, rows[lb].tokens_per_s))
    r = rows[label]
    r.best_fixed = best
    r.vs_best, r.vs_best_q25, r.vs_best_q75 = _quartiles(paired_ratios(runs[label], runs[best]))


def _roofline(r: Result, dec, mcfg, hcfg, params, draft, machine, kv_positions=None):
  eng = dec.engine
  st = dec.last_stats
  k = sum(st["drafted"]) / max(st["row_steps"], 1)     # drafts verified per row and step
  if eng.tree is not None:       # the trunk runs T+1 tokens (the heads' cost is overstated)
    k = eng.span
  nbytes, flops = step_cost(mcfg, hcfg, eng.cfg, k, r.batch_size, params,
                            draft[2] if draft and eng.drafter == "model" else None,
                            draft[0] if draft else None, kv_positions)
  r.step_bytes, r.step_flops = nbytes, flops
  place_on_roofline(r, machine)


def place_on_roofline(r: Result, machine: dict | None):
  """r's fraction of the machine's roofs (where they were measured) from its step's bytes and
  FLOPs."""
  if not machine or "memory_bandwidth_gb_s" not in machine or not r.steps or not r.step_bytes:
    return
  bw, peak = machine["memory_bandwidth_gb_s"] * 1e9, machine["matmul_gflop_s"] * 1e9
  steps_per_s = r.steps / r.seconds
  nbytes, flops = r.step_bytes, r.step_flops
  intensity = flops / nbytes
  r.bandwidth_fraction = nbytes * steps_per_s / bw
  r.roofline_fraction = flops * steps_per_s / min(peak, intensity * bw)
  r.bound = "memory" if intensity < peak / bw else "compute"
  llc = machine.get("last_level_cache_bytes")
  r.fits_in_cache = None if not llc else nbytes < llc
