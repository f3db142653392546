"""The demo trunk with sequential MTP heads (DeepSeek-V3 style modules) instead of parallel ones:
heads-only self-distillation on the trunk's own greedy continuations, like demo_distill.py.

  mtp-train --config=configs/demo_seq.py --workdir=runs/demo_seq \
      --config.train.init_from=pretrained/demo
"""

from configs import demo_distill


def get_config():
  c = demo_distill.get_config()
  c.heads.update(kind="sequential", num=3)
  c.train.update(steps=400, batch_size=16, eval_every=200, checkpoint_every=50)
  return c
