"""The other drafters through the same verification: prompt lookup (ngram) and a separate draft
model (classic speculative decoding). Greedy output equals plain greedy decoding; sampling stays
lossless; the draft model's own cache stays consistent."""

import os

import jax
import numpy as np
import pytest

from mtp_jax.config import DecodeConfig
from mtp_jax.decoding import engine as E
from mtp_jax.decoding import state as state_lib
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.models import model as model_lib
from mtp_jax.serving import api
from tests.helpers import assert_same_distribution


@pytest.fixture(scope="module")
def tiny(trained_tiny):
  _, workdir, _ = trained_tiny
  return ckpt_lib.load_model_dir(os.path.join(workdir, "model"))


PROMPTS = ["def f(x):\n    return x\n\ndef f(", "import os\nimport sys\nimport ", "class A:\n",
           "for i in range(10):\n    for i in range(", "x = 1\n"]


def _decoder(tiny, draft=None, **kw):
  mcfg, hcfg, params, tok = tiny
  return api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, ring_size=8, **kw),
                     draft=draft)


def _random_draft(tiny):
  mcfg, hcfg, _, _ = tiny
  import dataclasses
  dcfg = dataclasses.replace(mcfg, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)
  _, dparams = model_lib.split(model_lib.create(dcfg, hcfg, seed=3))
  return dcfg, hcfg, dparams


@pytest.mark.parametrize("drafter, k", [("ngram", 3), ("model", 3), ("model", 1), ("self", 4)])
def test_greedy_output_equals_plain(tiny, drafter, k):
  mcfg, hcfg, params, tok = tiny
  reqs = [api.Request(tok.encode(p), m) for p, m in zip(PROMPTS, [30, 7, 25, 40, 18])]
  plain = _decoder(tiny, k=0).run(reqs)
  if drafter == "ngram":
    dec = _decoder(tiny, k=k, drafter="ngram")
  elif drafter == "model":
    dec = _decoder(tiny, draft=_random_draft(tiny), k=k, drafter="model")
  else:   # the target as its own draft model: every draft should be accepted
    dec = _decoder(tiny, draft=(mcfg, hcfg, params), k=k, drafter="model")
  out = dec.run(reqs)
  assert [c.token_ids for c in out] == [c.token_ids for c in plain]
  st = dec.last_stats
  if drafter == "self":
    # Only possible if the draft model's cache holds every committed token at its position.
    assert min(st["acceptance_rate_per_position"]) > 0.97, st
  if drafter == "ngram":
    assert sum(st["accepted"]) > 0, "no lookup draft accepted: the test would prove nothing"


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_sampling_is_lossless(tiny, drafter):
  """Second and third generated tokens: same distribution with k=3 drafts as plain sampling
  (two-sample chi-square, fails below p=1e-4)."""
  mcfg, hcfg, params, tok = tiny
  prompt = tok.encode("for i in range(10):\n    for i in range(")

  def sample(k, seed, **kw):
    draft = _random_draft(tiny) if kw.get("drafter") == "model" else None
    eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=64, k=k, ring_size=8, **kw), tok.eod_id,
                   None if draft is None else draft[:2])
    p = params if draft is None else (params, draft[2])
    rows = []
    for r in range(16):
      state = eng.init_state(seed * 100 + r)
      pre = eng.prefill(p, [prompt] * 64, jax.random.key(seed * 100 + r), [1.0] * 64, [8] * 64,
                        [1.0] * 64)
      state = eng.insert(pre, state, list(range(64)), 3, 1.0, 8, 1.0)
      state = eng.generate(p, state, 8, sample=True)
      rows.append(np.asarray(state.rows.tokens)[:, len(prompt) + 1: len(prompt) + 3])
    return np.concatenate(rows), state_lib.stats(state)

  a, _ = sample(0, 1)
  b, st = sample(3, 2, drafter=drafter)
  pairs = lambda x: [f"{p},{q}" for p, q in x]
  assert_same_distribution(pairs(a), pairs(b), min_categories=4)
  assert sum(st["drafted"]) > 0
