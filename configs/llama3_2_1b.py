"""Llama 3.2 1B's architecture (16 layers, width 2048, 32 query / 8 kv heads, MLP 8,192,
vocabulary 128,256, tied embeddings, llama3 RoPE scaling): 1.24B trunk parameters, 4.9 GB in f32.
Random weights, for step costs (`mtp-bench --model=config:llama3_2_1b`); a 4,096-token tokenizer
stands in for the real one."""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                 d_ff=8192, max_seq_len=2048, rope_theta=500_000.0, rope_scaling="llama3",
                 rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_len=8192, tie_embeddings=True, tied_logits_scale=False)
  c.heads.update(kind="parallel", num=3)
  return c
