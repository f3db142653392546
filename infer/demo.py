"""`make demo`: complete a few shipped code prompts with the demo model, decoded speculatively
with its MTP heads, and check the text against plain greedy decoding.

  python -m infer.demo --model=pretrained/demo [--prompts=infer/demo_prompts.jsonl] [--k=3]
"""

import json
import sys
import time

from absl import app, flags, logging

from mtp_jax import api
from mtp_jax import checkpoint as ckpt_lib

_MODEL = flags.DEFINE_string("model", "pretrained/demo", "A model directory.")
_PROMPTS = flags.DEFINE_string("prompts", "infer/demo_prompts.jsonl", "JSONL with 'prompt' fields.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Tokens to generate per prompt.")
_K = flags.DEFINE_integer("k", -1, "Drafts per step (-1: all heads).")


def _timed(dec, prompts):
  dec.warmup(max(len(dec.tokenizer.encode(p)) for p in prompts))
  t0 = time.perf_counter()
  outs = dec.generate(prompts, max_new_tokens=_MAX_NEW.value)
  return outs, time.perf_counter() - t0


def main(argv):
  del argv
  try:
    prompts = [json.loads(l)["prompt"] for l in open(_PROMPTS.value) if l.strip()]
    spec = api.Decoder.load(_MODEL.value, batch_size=len(prompts), k=_K.value)
    plain = api.Decoder.load(_MODEL.value, batch_size=len(prompts), k=0)
  except (ckpt_lib.ModelDirError, OSError, KeyError, json.JSONDecodeError) as e:
    sys.exit(f"mtp-demo: error: {e}")
  outs, dt = _timed(spec, prompts)
  base, dt0 = _timed(plain, prompts)
  for p, o in zip(prompts, outs):
    print("=" * 72 + f"\n{p}\x1b[1m{o.text}\x1b[0m\n[{o.finish_reason}; "
          f"{len(o.token_ids)} tokens in {o.steps} steps: {o.acceptance_length:.2f} per step]")
  same = all(a.token_ids == b.token_ids for a, b in zip(outs, base))
  n = sum(len(o.token_ids) for o in outs)
  st = spec.last_stats
  print("=" * 72)
  print(f"speculative (k={spec.engine.kd}): {n / dt:.0f} tokens/s, acceptance length "
        f"{st['acceptance_length']:.2f}, per-position acceptance "
        + " ".join(f"{x:.2f}" for x in st["acceptance_rate_per_position"]))
  print(f"plain greedy:      {sum(len(o.token_ids) for o in base) / dt0:.0f} tokens/s "
        f"-> speedup {dt0 / dt:.2f}x; identical output: {same}")
  if not same:
    sys.exit("mtp-demo: error: speculative output differs from plain greedy decoding")


if __name__ == "__main__":
  logging.set_verbosity(logging.WARNING)
  app.run(main)
