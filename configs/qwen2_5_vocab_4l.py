"""Qwen2.5-0.5B's shape cut to 4 layers (vocabulary 151,936: the embedding holds 69% of its 198M
parameters), random weights: where a real vocabulary's unembedding is most of a step's bytes
(`mtp-bench --model=config:qwen2_5_vocab_4l`)."""

from configs import qwen2_5_0_5b


def get_config():
  c = qwen2_5_0_5b.get_config()
  c.model.update(n_layers=4)
  return c
