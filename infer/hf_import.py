"""mtp-import: a HF Llama / Mistral / Qwen2 / MiMo checkpoint -> an mtp-jax model directory with
heads.

  mtp-import --hf_model=HF_DIR --output=MODEL_DIR [--heads.kind=parallel] [--heads.num=3]
             [--max_seq_len=0] [--param_dtype=] [--eod_token=]
             [--mtp_layout=auto] [--medusa=MEDUSA_DIR] [--mtp_carry=]

The trunk keeps the checkpoint's weights. MTP layers the checkpoint ships (MiMo's, DeepSeek's
layout, Medusa heads: docs/models.md) become its heads; otherwise the heads are new (identity at
start) until `mtp-train --config=configs/heads_only.py --config.train.init_from=MODEL_DIR`
trains them.
"""

import sys

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from mtp_jax import config as config_lib
from mtp_jax.formats import hf as hf_lib

_HF_MODEL = flags.DEFINE_string("hf_model", None, "HF model directory (config.json, "
                                "model.safetensors or its index, tokenizer.json).")
_OUTPUT = flags.DEFINE_string("output", None, "The mtp-jax model directory to write.")
_HEADS = config_flags.DEFINE_config_dict(
    "heads", ml_collections.ConfigDict({"kind": "parallel", "num": 3}),
    "The heads to add: --heads.kind, --heads.num.")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 0, "Longest sequence the model serves; 0 = the "
                                    "checkpoint's max_position_embeddings (or sliding window).")
_PARAM_DTYPE = flags.DEFINE_enum("param_dtype", "", ("",) + config_lib.DTYPES,
                                 "Stored parameter dtype; '' = the checkpoint's.")
_EOD = flags.DEFINE_string("eod_token", "", "End-of-sequence token; '' = config.json's "
                           "eos_token_id (or generation_config.json's).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the new heads.")
_LAYOUT = flags.DEFINE_enum("mtp_layout", "auto", hf_lib.hf_mtp.LAYOUTS,
                            "The MTP layers the checkpoint ships: auto = use them where found "
                            "(then --heads.* is ignored); none = new heads instead; or name the "
                            "layout the checkpoint must hold.")
_MEDUSA = flags.DEFINE_string("medusa", "", "Medusa-1 heads: a directory holding "
                              "medusa_lm_head.safetensors, or the file.")
_CARRY = flags.DEFINE_enum("mtp_carry", "", ("", "raw", "normed"),
                           "What a DeepSeek-layout module hands the next draft: raw (DeepSeek-V3, "
                           "the default) or normed (GLM-4.5); '' = the layout's.")
flags.mark_flags_as_required(["hf_model", "output"])


def main(argv):
  del argv
  try:
    heads_cfg = config_lib._build(config_lib.HeadsConfig, "heads", _HEADS.value.to_dict())
    mcfg, note = hf_lib.import_model(_HF_MODEL.value, _OUTPUT.value, heads_cfg,
                                     max_seq_len=_MAX_SEQ_LEN.value,
                                     param_dtype=_PARAM_DTYPE.value, eod_token=_EOD.value,
                                     seed=_SEED.value, mtp_layout=_LAYOUT.value,
                                     medusa=_MEDUSA.value, mtp_carry=_CARRY.value)
  except (config_lib.ConfigError, ValueError, OSError) as e:
    sys.stderr.write(f"mtp-import: error: {e}\n")
    sys.exit(1)
  sys.stderr.write(f"mtp-import: wrote {_OUTPUT.value}: {mcfg.n_layers} layers, d_model "
                   f"{mcfg.d_model}, vocab {mcfg.vocab_size}, max_seq_len {mcfg.max_seq_len}, "
                   f"{mcfg.param_dtype}; {note}\n")


def run():
  logging.set_verbosity(logging.WARNING)
  app.run(main)


if __name__ == "__main__":
  run()
