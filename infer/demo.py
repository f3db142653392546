"""`make demo`: greedy completions of a few shipped code prompts by a model directory.

  python -m infer.demo --model=pretrained/demo [--prompts=infer/demo_prompts.jsonl]
"""

import json
import sys
import time

from absl import app, flags

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import generate as gen_lib
from mtp_jax import model as model_lib

_MODEL = flags.DEFINE_string("model", "pretrained/demo", "A model directory.")
_PROMPTS = flags.DEFINE_string("prompts", "infer/demo_prompts.jsonl", "JSONL with 'prompt' fields.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 96, "Tokens to generate per prompt.")


def main(argv):
  del argv
  try:
    mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(_MODEL.value)
    prompts = [json.loads(l)["prompt"] for l in open(_PROMPTS.value) if l.strip()]
  except (ckpt_lib.ModelDirError, OSError, KeyError, json.JSONDecodeError) as e:
    sys.exit(f"mtp-demo: error: {e}")
  graphdef, _ = model_lib.abstract(mcfg, hcfg)
  t0 = time.perf_counter()
  outs = gen_lib.complete(graphdef, params, tok, prompts, _MAX_NEW.value, mcfg.max_seq_len)
  dt = time.perf_counter() - t0
  for p, o in zip(prompts, outs):
    print("=" * 72 + f"\n{p}\x1b[1m{o['text']}\x1b[0m  [{o['finish_reason']}]")
  n = sum(len(o["token_ids"]) for o in outs)
  print("=" * 72 + f"\n{len(prompts)} prompts, {n} tokens in {dt:.1f}s (plain greedy decoding, "
        "compile included)")


if __name__ == "__main__":
  app.run(main)
