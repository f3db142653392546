"""mtp-export: an mtp-jax model directory -> HF safetensors (trunk) + mtp_heads.safetensors.

  mtp-export --model=MODEL_DIR --output=HF_DIR

The trunk is written under HF Llama-family names with its config.json and tokenizer.json, so
transformers' from_pretrained loads it; the heads go to mtp_heads.safetensors beside it (and
`mtp-import --hf_model=HF_DIR` picks them up again), or, where they were imported from a published
layout (MiMo, DeepSeek's, Medusa-1: docs/models.md), back to it.
"""

import sys

from absl import app, flags, logging

from mtp_jax import config as config_lib
from mtp_jax.formats import hf as hf_lib

_MODEL = flags.DEFINE_string("model", None, "The mtp-jax model directory.")
_OUTPUT = flags.DEFINE_string("output", None, "The HF directory to write.")
flags.mark_flags_as_required(["model", "output"])


def main(argv):
  del argv
  try:
    files = hf_lib.export_model(_MODEL.value, _OUTPUT.value)
  except (config_lib.ConfigError, ValueError, OSError) as e:
    sys.stderr.write(f"mtp-export: error: {e}\n")
    sys.exit(1)
  sys.stderr.write(f"mtp-export: wrote {', '.join(files)} to {_OUTPUT.value}\n")


def run():
  logging.set_verbosity(logging.WARNING)
  app.run(main)


if __name__ == "__main__":
  run()
