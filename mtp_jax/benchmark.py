"""Decoding benchmark: modes x batch sizes on the same prompts, measured side by side.

A mode is 'vanilla' (plain decoding, k = 0), 'mtp:K' (K drafts from the heads per step) or
'adaptive' (k chosen per step from the calibrated cost table and acceptance). Every
(batch size, mode) pair gets its own compiled engine, warmed up before timing; timed runs of all
modes are interleaved repeat by repeat, so that a noisy machine slows all of them alike.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from mtp_jax import api
from mtp_jax import data as data_lib
from mtp_jax.config import DataConfig, DecodeConfig


def parse_mode(mode: str) -> int | str:
  """'vanilla' -> 0, 'mtp:K' -> K, 'adaptive' -> 'auto'."""
  if mode == "vanilla":
    return 0
  if mode == "adaptive":
    return "auto"
  if mode.startswith("mtp:") and mode[4:].isdigit():
    return int(mode[4:])
  raise ValueError(f"--modes: unknown mode {mode!r} (expected 'vanilla', 'mtp:K' or 'adaptive')")


def heldout_prompts(tokenizer, n: int, prompt_tokens: int, data_cfg: DataConfig | None = None,
                    seed: int = 0) -> list[list[int]]:
  """n prompts of prompt_tokens tokens cut at line starts of held-out standard-library files."""
  cfg = data_cfg or DataConfig()
  _, heldout = data_lib.split_files(cfg)
  rng = np.random.default_rng(seed)
  root = data_lib.corpus_root(cfg)
  out = []
  while len(out) < n:
    text = data_lib.read_text(root, heldout[int(rng.integers(len(heldout)))])
    lines = text.splitlines(keepends=True)
    if len(lines) < 20:
      continue
    start = int(rng.integers(0, len(lines) - 10))
    ids = tokenizer.encode("".join(lines[start:]))
    if len(ids) >= prompt_tokens:
      out.append(ids[:prompt_tokens])
  return out


@dataclasses.dataclass
class Result:
  mode: str
  batch_size: int
  tokens_per_s: float
  acceptance_length: float
  acceptance_rate_per_position: list
  new_tokens: int
  seconds: float
  speedup: float = 1.0


def run(model_dir: str, modes: list[str], batch_sizes: list[int], max_new_tokens: int,
        prompt_tokens: int = 64, rounds: int = 1, repeats: int = 2, log=print,
        cost_table: str | None = None) -> list[Result]:
  base = api.Decoder.load(model_dir, batch_size=1, k=0)
  mcfg, hcfg = base.engine.model_cfg, base.engine.heads_cfg
  results = []
  for b in batch_sizes:
    prompts = heldout_prompts(base.tokenizer, b * rounds, prompt_tokens, seed=b)
    reqs = [api.Request(p, max_new_tokens) for p in prompts]
    decoders = {}
    for mode in modes:
      k = parse_mode(mode)
      # The cache holds what a row can reach (attention reads all of it every step).
      max_len = min(mcfg.max_seq_len, prompt_tokens + max_new_tokens + hcfg.num + 2)
      dcfg = DecodeConfig(batch_size=b, k=-1 if k == "auto" else k, ring_size=32,
                          adaptive=k == "auto", max_len=max_len)
      dec = api.Decoder(mcfg, hcfg, base.params, base.tokenizer, dcfg)
      if k == "auto":
        dec.calibrate(cost_table)
      dec.warmup(prompt_tokens)
      dec.run(reqs[:b])                                   # host-side helpers warmed too
      decoders[mode] = dec
    best = {m: None for m in modes}
    for _ in range(repeats):
      for mode in modes:
        t0 = time.perf_counter()
        outs = decoders[mode].run(reqs)
        dt = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        st = decoders[mode].last_stats
        r = Result(mode, b, n / dt, st["acceptance_length"], st["acceptance_rate_per_position"],
                   n, dt)
        if best[mode] is None or r.tokens_per_s > best[mode].tokens_per_s:
          best[mode] = r
    base_tps = best.get("vanilla").tokens_per_s if "vanilla" in best else None
    for mode in modes:
      r = best[mode]
      if base_tps:
        r.speedup = r.tokens_per_s / base_tps
      results.append(r)
      log(format_row(r))
  return results


HEADER = ("| mode | batch | tokens/s | speedup | acceptance length | acceptance per position |\n"
          "|---|---|---|---|---|---|")


def format_row(r: Result) -> str:
  per = " ".join(f"{x:.2f}" for x in r.acceptance_rate_per_position) or "-"
  return (f"| {r.mode} | {r.batch_size} | {r.tokens_per_s:.1f} | {r.speedup:.2f} | "
          f"{r.acceptance_length:.2f} | {per} |")
