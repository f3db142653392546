"""Corpus -> token stream -> batches.

A corpus is a directory of text files matched by a glob (by default the running Python's standard
library), or a JSONL file of records (jsonl.py). Files are split into train / held-out by a hash
of their relative path, so the split never depends on the machine or on the order files are
listed. The batch iterator is a pure function of (seed, batch index): its whole state is the
index of the next batch, which the checkpoint stores, so a resumed run sees exactly the batches
an uninterrupted one would.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import os
import sysconfig

import numpy as np

from mtp_jax.config import DataConfig


def corpus_root(cfg: DataConfig) -> str:
  return cfg.corpus_dir or sysconfig.get_paths()["stdlib"]


def list_files(cfg: DataConfig) -> list[str]:
  """All corpus files, as paths relative to the corpus root, sorted."""
  root = corpus_root(cfg)
  if not os.path.isdir(root):
    raise FileNotFoundError(f"data.corpus_dir={root!r}: not a directory")
  files = sorted(
      os.path.relpath(p, root)
      for p in globlib.glob(os.path.join(root, cfg.glob), recursive=True)
      if os.path.isfile(p) and not (cfg.exclude and cfg.exclude in os.path.relpath(p, root)))
  if cfg.max_files:
    files = files[: cfg.max_files]
  if not files:
    raise FileNotFoundError(f"data.glob={cfg.glob!r}: no files under {root}")
  return files


def is_heldout(relpath: str, heldout_permille: int) -> bool:
  h = int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:4], "little")
  return h % 1000 < heldout_permille


def split_files(cfg: DataConfig) -> tuple[list[str], list[str]]:
  files = list_files(cfg)
  heldout = [f for f in files if is_heldout(f, cfg.heldout_permille)]
  train = [f for f in files if not is_heldout(f, cfg.heldout_permille)]
  if not train:
    raise ValueError(f"data.heldout_permille={cfg.heldout_permille}: no training files left")
  return train, heldout


def read_text(root: str, relpath: str) -> str:
  with open(os.path.join(root, relpath), "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def iter_texts(cfg: DataConfig, files: list[str], max_bytes: int | None = None):
  root, total = corpus_root(cfg), 0
  for f in files:
    text = read_text(root, f)
    yield text
    total += len(text)
    if max_bytes and total >= max_bytes:
      return


def tokenize_files(cfg: DataConfig, files: list[str], tokenizer, chunk: int = 256) -> np.ndarray:
  """One token stream: every file's tokens followed by the end-of-document token."""
  root, parts = corpus_root(cfg), []
  for i in range(0, len(files), chunk):
    texts = [read_text(root, f) for f in files[i: i + chunk]]
    for ids in tokenizer.encode_batch(texts):
      parts.append(np.asarray(ids + [tokenizer.eod_id], np.int32))
  if not parts:
    return np.zeros((0,), np.int32)
  return np.concatenate(parts)


class BatchIterator:
  """Deterministic windows of `window` tokens from a token stream.

  Windows start at multiples of `window` - 1 (consecutive windows share one token, so every
  token is a target once per epoch); each epoch visits all windows in a permutation seeded by
  (seed, epoch). `state()` / `restore()` carry the index of the next batch.
  """

  def __init__(self, tokens: np.ndarray, batch_size: int, window: int, seed: int):
    stride = window - 1
    self.num_windows = (len(tokens) - 1) // stride
    if self.num_windows < 1:
      raise ValueError(f"token stream of {len(tokens)} tokens is shorter than one window "
                       f"of {window}; use a larger corpus or a smaller data.seq_len")
    self.tokens, self.batch_size, self.window, self.stride = tokens, batch_size, window, stride
    self.seed, self.next_batch = seed, 0
    self._perm_epoch, self._perm = -1, None

  def _starts(self, first: int, count: int) -> np.ndarray:
    out = np.empty((count,), np.int64)
    for j in range(count):
      i = first + j
      epoch, idx = divmod(i, self.num_windows)
      if epoch != self._perm_epoch:
        self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        self._perm_epoch = epoch
      out[j] = self._perm[idx] * self.stride
    return out

  def batch(self, index: int) -> np.ndarray:
    starts = self._starts(index * self.batch_size, self.batch_size)
    return np.stack([self.tokens[s: s + self.window] for s in starts])

  def __next__(self) -> np.ndarray:
    b = self.batch(self.next_batch)
    self.next_batch += 1
    return b

  def __iter__(self):
    return self

  def state(self) -> dict:
    return {"next_batch": int(self.next_batch), "seed": int(self.seed)}

  def restore(self, state: dict):
    if int(state["seed"]) != self.seed:
      raise ValueError(f"data iterator state has seed {state['seed']}, config has {self.seed}")
    self.next_batch = int(state["next_batch"])


class PromptBatches(BatchIterator):
  """Deterministic batches of prompt rows (jsonl.prompt_rows: [N, P + 1], each a right-padded
  prompt, then its length), in BatchIterator's order: each epoch visits every row once in a
  permutation seeded by (seed, epoch); the same state and restore. A batch is (prompt_BP,
  lengths_B)."""

  def __init__(self, rows_NP1: np.ndarray, batch_size: int, seed: int):
    if len(rows_NP1) < 1:
      raise ValueError("no distillation prompts to draw batches from")
    self.tokens, self.batch_size, self.seed, self.next_batch = rows_NP1, batch_size, seed, 0
    self.num_windows, self.window, self.stride = len(rows_NP1), rows_NP1.shape[1] - 1, 1
    self._perm_epoch, self._perm = -1, None

  def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    rows = self.tokens[self._starts(index * self.batch_size, self.batch_size)]
    return rows[:, :-1], rows[:, -1]


def heldout_batches(tokens: np.ndarray, batch_size: int, window: int, num_batches: int) -> list:
  """A fixed list of evaluation batches (the first windows of the held-out stream)."""
  stride = window - 1
  n = min(num_batches * batch_size, (len(tokens) - 1) // stride)
  if n < 1:
    return []
  wins = np.stack([tokens[i * stride: i * stride + window] for i in range(n)])
  return [wins[i: i + batch_size] for i in range(0, n - batch_size + 1, batch_size)] or [wins]
