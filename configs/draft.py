"""The draft model of `mtp-bench --modes=draft:K` (pretrained/draft): classic two-model
speculative decoding's small drafter for the demo model. Same corpus and tokenizer as the demo
(data.tokenizer reuses pretrained/demo's), a quarter of its width and half its depth; its own
MTP head is unused (one, the minimum).

  mtp-train --config=configs/draft.py --workdir=/tmp/draft_run
  cp -r /tmp/draft_run/model pretrained/draft
"""

from configs import demo


def get_config():
  c = demo.get_config()
  c.model.update(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=384)
  c.heads.update(num=1)
  c.data.update(tokenizer="pretrained/demo")
  c.train.update(steps=800, lr=3e-3, warmup_steps=50, eval_every=400, checkpoint_every=200,
                 head_loss_stride=4)
  return c
