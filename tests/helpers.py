"""What the tests share: the repository root, held-out prompts, counting compiles, and the
lossless-sampling check (rounds of sampled rows, a two-sample chi-square test)."""

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
from scipy import stats as sstats

from mtp_jax.config import DecodeConfig
from mtp_jax.decoding import engine as engine_lib
from mtp_jax.decoding import state as state_lib
from mtp_jax.training import data as data_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def infer(args, **kw):
  """mtp-infer in a process of its own (python -m infer.main args), output and errors piped."""
  return subprocess.Popen([sys.executable, "-m", "infer.main", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT), **kw)


def killed_and_resumed(args, out, n: int, at: int = 5) -> list[dict]:
  """Runs the batch job of `args` (writing `out`), SIGKILLs it once `at` records are written
  (fewer than its n), runs it again to the end. -> the output's records."""
  p = infer(args)
  deadline = time.time() + 300
  while time.time() < deadline and p.poll() is None:
    if out.exists() and out.read_text().count("\n") >= at:
      break
    time.sleep(0.05)
  assert p.poll() is None, "the job ended before it could be killed: " + p.communicate()[1][-2000:]
  os.kill(p.pid, signal.SIGKILL)
  p.wait()
  assert at <= out.read_bytes().count(b"\n") < n
  p = infer(args)
  _, err = p.communicate(timeout=600)
  assert p.returncode == 0, err[-3000:]
  return [json.loads(line) for line in out.read_text().splitlines()]


def heldout_prompts(cfg, tok, n, seed=0):
  """n held-out code snippets of different lengths (1-40 tokens), as token ids."""
  _, heldout = data_lib.split_files(cfg.data)
  text = data_lib.read_text(data_lib.corpus_root(cfg.data), heldout[0])
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    start = int(rng.integers(0, len(text) - 400))
    out.append(tok.encode(text[start: start + int(rng.integers(10, 200))])[:40] or [5])
  return out


class _CompileLog(logging.Handler):
  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    if "compiling" in record.getMessage().lower():
      self.messages.append(record.getMessage()[:200])


@contextlib.contextmanager
def compiles():
  """with compiles() as messages: ... -> what JAX compiled inside the block (jax.log_compiles)."""
  log = _CompileLog()
  logger = logging.getLogger("jax")
  logger.addHandler(log)
  try:
    with jax.log_compiles(True):
      yield log.messages
  finally:
    logger.removeHandler(log)


def sample_rounds(params, eng, prompt, seed, n_rounds=24, batch=64, max_new=3, top_k=4,
                  penalty=1.0):
  """Generated tokens [n_rounds * batch, max_new] of rows sampling the same prompt at
  temperature 1 (-1 past a row's end), and the last round's statistics (state.stats)."""
  rows = []
  for r in range(n_rounds):
    key = jax.random.key(seed * 1000 + r)
    state = eng.init_state(seed * 1000 + r)
    prefix = eng.prefill(params, [prompt] * batch, key, [1.0] * batch, [top_k] * batch,
                         [1.0] * batch, [penalty] * batch)
    state = eng.insert(prefix, state, list(range(batch)), max_new, 1.0, top_k, 1.0, penalty)
    state = eng.generate(params, state, 8, sample=True)
    toks = np.asarray(state.rows.tokens)[:, len(prompt): len(prompt) + max_new]
    lens = np.asarray(state.rows.length) - len(prompt)
    rows.append(np.where(np.arange(max_new)[None] < lens[:, None], toks, -1))
  return np.concatenate(rows), state_lib.stats(state)


def sample_engine(mcfg, hcfg, params, tok, k, n_rounds, batch, prompt, max_new, seed, top_k=4,
                  penalty=1.0, threshold=0.0, adaptive=False):
  """sample_rounds on an engine of k drafts (adaptive: up to k, no margin asked over plain
  decoding, so that the tiny heads' drafts are verified by the adaptive loop's sampled
  variants)."""
  eng = engine_lib.Engine(mcfg, hcfg, DecodeConfig(batch_size=batch, k=k, ring_size=8,
                                                   confidence_threshold=threshold,
                                                   adaptive=adaptive, adapt_margin=0.0),
                          tok.eod_id)
  return sample_rounds(params, eng, prompt, seed, n_rounds, batch, max_new, top_k, penalty)


def second_and_third(tokens_NM):
  """Each row's 2nd and 3rd generated tokens as one outcome: the first comes from prefill, these
  from draft-and-verify steps."""
  return [f"{a},{b}" for a, b in np.asarray(tokens_NM)[:, 1:3]]


def homogeneity(samples_a, samples_b, min_count: int = 20):
  """Chi-square test that two samples of hashable outcomes come from one distribution.
  Categories with fewer than min_count samples in all are pooled.
  -> (p-value, number of categories, the 2 x C contingency table)."""
  pa, pb = list(samples_a), list(samples_b)
  cats = sorted(set(pa) | set(pb))
  ca = np.array([pa.count(c) for c in cats])
  cb = np.array([pb.count(c) for c in cats])
  small = (ca + cb) < min_count
  table = np.stack([np.r_[ca[~small], ca[small].sum()], np.r_[cb[~small], cb[small].sum()]])
  table = table[:, table.sum(0) > 0]
  return sstats.chi2_contingency(table)[1], table.shape[1], table


def assert_same_distribution(samples_a, samples_b, min_categories: int = 5):
  """Two samples of outcomes pass a chi-square test of homogeneity: it fails below p = 1e-4 (a
  correct sampler fails once in 10,000 runs), over at least min_categories categories."""
  pvalue, n_cats, table = homogeneity(samples_a, samples_b)
  assert n_cats >= min_categories, f"too few categories for a meaningful test: {table}"
  assert pvalue > 1e-4, (pvalue, table)
