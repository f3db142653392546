"""Prompts for benchmarks and quality checks: held-out standard-library code cut to a token
length, a JSONL file in mtp-infer's input form, or a directory of source files."""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from mtp_jax.config import DataConfig
from mtp_jax.training import data as data_lib


def heldout_prompts(tokenizer, n: int, prompt_tokens: int, data_cfg: DataConfig | None = None,
                    seed: int = 0) -> list[list[int]]:
  """n prompts of prompt_tokens tokens cut at line starts of held-out standard-library files."""
  cfg = data_cfg or DataConfig()
  _, heldout = data_lib.split_files(cfg)
  return _cut_prompts(tokenizer, lambda i: data_lib.read_text(data_lib.corpus_root(cfg),
                                                             heldout[i]),
                      len(heldout), n, prompt_tokens, seed)


def _cut_prompts(tokenizer, read, num_files, n, prompt_tokens, seed):
  rng = np.random.default_rng(seed)
  out, tries = [], 0
  while len(out) < n:
    tries += 1
    if tries > 100 * n + 1000:
      raise ValueError(f"--prompts: could not cut {n} prompts of {prompt_tokens} tokens")
    lines = read(int(rng.integers(num_files))).splitlines(keepends=True)
    if len(lines) < 20:
      continue
    start = int(rng.integers(0, len(lines) - 10))
    ids = tokenizer.encode("".join(lines[start:]))
    if len(ids) >= prompt_tokens:
      out.append(ids[:prompt_tokens])
  return out


def load_prompts(spec: str, tokenizer, n: int, prompt_tokens: int, seed: int = 0):
  """--prompts: '' (held-out standard-library code), a JSONL file in mtp-infer's input form
  (plain 'prompt' or OpenAI 'body.prompt'; cycled to n prompts, each cut to prompt_tokens), or a
  directory of source files (prompts cut at line starts)."""
  if not spec:
    return heldout_prompts(tokenizer, n, prompt_tokens, seed=seed)
  if os.path.isdir(spec):
    files = sorted(f for f in glob.glob(os.path.join(spec, "**", "*"), recursive=True)
                   if os.path.isfile(f))
    if not files:
      raise ValueError(f"--prompts={spec}: the directory holds no files")
    read = lambda i: open(files[i], encoding="utf-8", errors="replace").read()
    return _cut_prompts(tokenizer, read, len(files), n, prompt_tokens, seed)
  if not os.path.isfile(spec):
    raise ValueError(f"--prompts={spec}: no such file or directory")
  texts = []
  with open(spec, "rb") as f:
    for no, raw in enumerate(f, 1):
      if not raw.strip():
        continue
      try:
        obj = json.loads(raw)
        p = obj["body"]["prompt"] if "body" in obj else obj["prompt"]
        assert isinstance(p, str) and p
      except (ValueError, KeyError, TypeError, AssertionError):
        raise ValueError(f"--prompts={spec}: line {no} has no prompt string") from None
      texts.append(p)
  if not texts:
    raise ValueError(f"--prompts={spec}: no prompts")
  return [tokenizer.encode(texts[i % len(texts)])[-prompt_tokens:] for i in range(n)]
