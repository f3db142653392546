"""The shipped demo model loads, and speculative greedy decoding with it equals plain decoding."""

import os

import pytest

from mtp_jax.bench import benchmark
from mtp_jax.serving import api
from tests.helpers import ROOT

DEMO = os.path.join(ROOT, "pretrained", "demo")


@pytest.mark.skipif(not os.path.isdir(DEMO), reason="pretrained/demo is not in this checkout")
def test_demo_model_speculative_equals_plain_and_heads_are_accepted():
  rel = os.path.relpath(DEMO)                       # model directories load from relative paths
  plain = api.Decoder.load(rel, batch_size=4, k=0, max_len=128)
  spec = api.Decoder.load(rel, batch_size=4, k=3, max_len=128)
  prompts = benchmark.heldout_prompts(plain.tokenizer, 6, 32, seed=1)
  reqs = [api.Request(p, n) for p, n in zip(prompts, [40, 25, 60, 33, 48, 12])]
  a, b = plain.run(reqs), spec.run(reqs)
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  st = spec.last_stats
  # The demo exists to show speculation paying: its heads are accepted often.
  assert st["acceptance_length"] > 1.5, st
