"""The shipped demo model (pretrained/demo): a 4-layer, 256-wide code model with 3 parallel MTP
heads, trained on the standard library. Stage 1 is joint training; stage 2 (demo_distill.py)
self-distils the heads on the trunk's own greedy continuations."""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=640,
                 max_seq_len=1024)
  c.heads.update(kind="parallel", num=3)
  c.data.update(glob="**/*.py", tokenizer_train_bytes=8_000_000, seq_len=256, heldout_permille=20)
  c.train.update(batch_size=16, steps=1200, lr=3e-3, warmup_steps=100, head_loss_stride=2,
                 checkpoint_every=100, eval_every=600, eval_batches=4, log_every=25,
                 save_dtype="bfloat16")
  return c
