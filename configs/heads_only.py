"""Heads for a model you bring (`mtp-import`): the trunk stays frozen and the heads learn by
self-distillation on the trunk's own greedy continuations of corpus prompts.

  mtp-train --config=configs/heads_only.py --workdir=DIR --config.train.init_from=MODEL_DIR \
      [--config.data.corpus_dir=TEXT_DIR --config.data.glob='**/*.txt']

The model section comes from init_from; the heads section must match the imported heads (or
it starts new ones of this shape). Defaults train on the standard library's Python source.
"""

from configs import base


def get_config():
  c = base.get_config()
  c.heads.update(kind="parallel", num=3)
  c.data.update(glob="**/*.py", seq_len=256, heldout_permille=20)
  c.train.update(mode="heads_only", batch_size=8, steps=500, lr=2e-3, warmup_steps=20,
                 distill_source="generated", distill_target="hard", distill_prompt_len=64,
                 checkpoint_every=100, eval_every=250, eval_batches=4, log_every=25)
  return c
