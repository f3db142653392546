"""Qwen2.5-0.5B's architecture (24 layers, width 896, 14 query / 2 kv heads, MLP 4,864, vocabulary
151,936, tied embeddings, q/k/v biases): 494M trunk parameters, 1.98 GB in f32. With random weights
(`mtp-bench --model=config:qwen2_5_0_5b`) it measures what a step of a real shape costs; its
tokens mean nothing (a 4,096-token tokenizer stands in for the real one, see
mtp_jax/bench/benchmark.py `load_model`). For decoding with the real model: mtp-import."""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                 d_ff=4864, max_seq_len=2048, rope_theta=1_000_000.0, tie_embeddings=True,
                 tied_logits_scale=False, qkv_bias=True)
  c.heads.update(kind="parallel", num=3)
  return c
