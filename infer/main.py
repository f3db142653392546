"""mtp-infer: a JSONL file of prompts in, a JSONL file of completions out, decoded speculatively.

  mtp-infer --model=DIR --input=IN.jsonl --output=OUT.jsonl [--k=auto|0..K] [--batch_size=N]
            [--temperature=T] [--top_p=P] [--top_k=K] [--max_new_tokens=N] [--seed=S]

Rerunning with the same --output resumes: ids already written are skipped.
"""

import os
import sys

from absl import app, flags, logging

from mtp_jax import api, batch
from mtp_jax import checkpoint as ckpt_lib

_MODEL = flags.DEFINE_string("model", None, "A model directory.")
_INPUT = flags.DEFINE_string("input", None, "JSONL requests.")
_OUTPUT = flags.DEFINE_string("output", None, "JSONL results (appended; resumes).")
_K = flags.DEFINE_string("k", "auto", "Drafts per step: 'auto' (adaptive), -1 all heads, 0 plain.")
_CALIBRATE = flags.DEFINE_bool("calibrate", False, "Re-measure the cost table of --k=auto.")
_COSTS = flags.DEFINE_string("cost_table", None, "Cost table JSON (default: ~/.cache/mtp_jax).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Decode slots.")
_TEMP = flags.DEFINE_float("temperature", 0.0, "Default temperature (0 = greedy).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Default top-p.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Default top-k (0 = off).")
_PEN = flags.DEFINE_float("repetition_penalty", 1.0, "Default repetition penalty (1 = off).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Default new tokens per request.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed of the job.")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "Cache length per slot (0: the model's context).")
_QUIET = flags.DEFINE_bool("quiet", False, "No progress on stderr.")
flags.mark_flags_as_required(["model", "input", "output"])


def main(argv):
  del argv
  if not os.path.isfile(_INPUT.value):
    sys.exit(f"mtp-infer: error: input file not found: {_INPUT.value}")
  try:
    k = _K.value if _K.value == "auto" else int(_K.value)
    dec = api.Decoder.load(_MODEL.value, batch_size=_BATCH.value, k=k, seed=_SEED.value,
                           max_len=_MAX_LEN.value)
  except (ckpt_lib.ModelDirError, ValueError) as e:
    sys.exit(f"mtp-infer: error: {e}")
  if k == "auto":
    dec.calibrate(_COSTS.value, force=_CALIBRATE.value)
  defaults = batch.Defaults(_MAX_NEW.value, _TEMP.value, _TOP_P.value, _TOP_K.value, _PEN.value)
  log = None if _QUIET.value else (lambda s: print(s, file=sys.stderr, flush=True))
  summary = batch.run_job(dec, _INPUT.value, _OUTPUT.value, defaults, log)
  print(summary, file=sys.stderr)


def run():
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  app.run(main)


if __name__ == "__main__":
  run()
