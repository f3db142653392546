"""mtp-bench: throughput of plain vs speculative decoding across batch sizes, side by side.

  mtp-bench --model=pretrained/demo --modes=vanilla,mtp:1,mtp:2,mtp:3,adaptive --batch_sizes=1,8 \
            --max_new_tokens=128 [--out=DIR]
"""

import dataclasses
import json
import os
import sys

from absl import app, flags, logging

from mtp_jax import benchmark
from mtp_jax import checkpoint as ckpt_lib

_MODEL = flags.DEFINE_string("model", "pretrained/demo", "A model directory.")
_MODES = flags.DEFINE_list("modes", ["vanilla", "mtp:1", "mtp:2", "mtp:3", "adaptive"],
                           "vanilla | mtp:K | adaptive")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "8"], "Slot counts to measure.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 64, "Prompt length in tokens (held-out code).")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Prompts per slot.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed repeats per mode (the best is kept).")
_OUT = flags.DEFINE_string("out", "", "Directory for results.json and results.md.")


def main(argv):
  del argv
  try:
    for m in _MODES.value:
      benchmark.parse_mode(m)
    sizes = [int(b) for b in _BATCH.value]
  except ValueError as e:
    sys.exit(f"mtp-bench: error: {e}")
  print(benchmark.HEADER, flush=True)
  try:
    results = benchmark.run(_MODEL.value, _MODES.value, sizes, _MAX_NEW.value, _PROMPT.value,
                            _ROUNDS.value, _REPEATS.value, log=lambda s: print(s, flush=True))
  except ckpt_lib.ModelDirError as e:
    sys.exit(f"mtp-bench: error: {e}")
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "results.json"), "w") as f:
      json.dump({"results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
    with open(os.path.join(_OUT.value, "results.md"), "w") as f:
      f.write(benchmark.HEADER + "\n" + "\n".join(benchmark.format_row(r) for r in results) + "\n")


def run():
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  app.run(main)


if __name__ == "__main__":
  run()
