"""Llama 3.1 8B's architecture (32 layers, width 4096, 32 query / 8 kv heads, MLP 14,336,
vocabulary 128,256, untied embeddings, llama3 RoPE scaling): 8.0B trunk parameters, 32 GB in f32 and
16 GB in bf16. For memory accounting (mtp_jax/decoding/memory.py, `mtp-infer --batch_size=auto`);
too large to bench on a 24 GiB CPU machine."""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                 d_ff=14336, max_seq_len=8192, rope_theta=500_000.0, rope_scaling="llama3",
                 rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_len=8192, tie_embeddings=False)
  c.heads.update(kind="parallel", num=3)
  return c
