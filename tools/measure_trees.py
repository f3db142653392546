"""A model's token trees from its heads' measured top-i acceptance (docs/decoding.md#token-trees).

  python tools/measure_trees.py [MODEL_DIR] [N_PROMPTS]

What `mtp-train` does after training, for a model directory that has no trees.json (one trained
before it wrote them, or imported): N_PROMPTS held-out prompts of 64 tokens (standard-library
files of the data split's held-out part), the trunk's own greedy continuation of 128 tokens,
and along it how often each rank of each head's top 8 is the trunk's token (shapes.topk_hits,
head i counted where every earlier head's token was within its top 8). Writes MODEL_DIR/
trees.json: the rates and a tree per budget 4, 8, 16, 32 built from them.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mtp_jax.bench.prompts import heldout_prompts  # noqa: E402
from mtp_jax.decoding import shapes  # noqa: E402
from mtp_jax.formats import checkpoint as ckpt_lib  # noqa: E402
from mtp_jax.models import model as M  # noqa: E402
from mtp_jax.training import generate as gen_lib  # noqa: E402
from mtp_jax.training import losses  # noqa: E402

PROMPT, NEW, BATCH = 64, 128, 16


def main(model_dir: str, n: int):
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(model_dir)
  graphdef, _ = M.abstract(mcfg, hcfg)
  prompts = np.asarray(heldout_prompts(tok, n, PROMPT, seed=12345), np.int32)
  count = jax.jit(lambda p, x: losses.agreement(M.bind(graphdef, p), x, tok.eod_id, PROMPT - 1,
                                                shapes.DEFAULT_TOP_K)[2])
  hits, trials = 0, 0
  for i in range(0, len(prompts), BATCH):
    batch = jnp.asarray(prompts[i:i + BATCH])
    lengths = jnp.full((batch.shape[0],), PROMPT, jnp.int32)
    tokens = gen_lib.greedy_generate(graphdef, params, batch, lengths, NEW)
    h, t = count(params, tokens)
    hits, trials = hits + np.asarray(h), trials + np.asarray(t)
  rates = shapes.rates_from_hits(hits, trials)
  trees = {b: shapes.build_tree(rates, b) for b in shapes.DEFAULT_BUDGETS}
  path = os.path.join(model_dir, shapes.TREES_FILE)
  shapes.save_trees(path, rates, trees)
  for i, r in enumerate(rates):
    print(f"head {i + 1}: top-1 {r[0]:.3f}, top-{len(r)} {sum(r):.3f} ({int(trials[i])} trials)")
  for b, t in trees.items():
    print(f"tree:{b}: depth {t.max_depth}, expected tokens per step "
          f"{1 + shapes.expected_accepted(t, rates):.2f}")
  print(f"wrote {path}")


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "pretrained/demo",
       int(sys.argv[2]) if len(sys.argv) > 2 else 64)
