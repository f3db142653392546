"""Stage 2 of the demo: heads-only self-distillation on the trunk's own greedy continuations of
standard-library prompts. Needs --config.train.init_from=<stage-1 model directory>."""

from configs import demo


def get_config():
  c = demo.get_config()
  c.train.update(mode="heads_only", steps=800, lr=2e-3, warmup_steps=20, head_loss_stride=1,
                 distill_source="generated", distill_target="hard", distill_prompt_len=64,
                 eval_every=200)
  return c
