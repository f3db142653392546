"""The test configuration: a 2-layer model on a few stdlib packages, trains in about a minute."""

from configs import base


def get_config():
  c = base.get_config()
  c.model.update(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192,
                 max_seq_len=128)
  c.heads.update(kind="parallel", num=4)
  c.data.update(glob="json/**/*.py", tokenizer_train_bytes=400_000, seq_len=64,
                heldout_permille=200)
  c.train.update(batch_size=8, steps=60, lr=3e-3, warmup_steps=5, checkpoint_every=20,
                 eval_every=30, eval_batches=2, log_every=10, distill_prompt_len=16)
  return c
