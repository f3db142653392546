"""A model larger than this CPU's 32 MiB last-level cache, for `mtp-bench --model=config:bench_large`
(random weights: speed only). 8 layers of width 1024: ~95M parameters, ~380 MB in f32, so each
decode step streams its weights from memory, as decoding on an accelerator does."""

from configs import demo


def get_config():
  c = demo.get_config()
  c.model.update(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, d_ff=2816)
  c.heads.update(num=3)
  return c
