"""mtp-infer: a JSONL file of prompts in, a JSONL file of completions out, decoded speculatively.

  mtp-infer --model=DIR --input=IN.jsonl --output=OUT.jsonl [--k=auto|0..K]
            [--batch_size=auto|N] [--kv_budget_gb=G] [--temperature=T] [--top_p=P] [--top_k=K]
            [--max_new_tokens=N] [--seed=S] [--quiet]

Input lines are plain requests or OpenAI batch request lines (see mtp_jax/batch.py). Rerunning
with the same --output resumes: ids already written are skipped.
"""

import dataclasses
import json
import os
import sys

import jax
from absl import app, flags, logging

from infer import mesh_flags
from mtp_jax import api, batch
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import engine as engine_lib
from mtp_jax import sharding as sharding_lib
from mtp_jax.config import ConfigError, DecodeConfig

_MODEL = flags.DEFINE_string("model", None, "A model directory.")
_INPUT = flags.DEFINE_string("input", None, "JSONL requests.")
_OUTPUT = flags.DEFINE_string("output", None, "JSONL results (appended; resumes).")
_K = flags.DEFINE_string("k", "auto", "Drafts per step: 'auto' (adaptive), -1 all heads, 0 plain.")
_CALIBRATE = flags.DEFINE_bool("calibrate", False, "Re-measure the cost table of --k=auto.")
_COSTS = flags.DEFINE_string("cost_table", None, "Cost table JSON, which also keeps the "
                             "acceptance runs measured (default: ~/.cache/mtp_jax).")
_BATCH = flags.DEFINE_string(
    "batch_size", "auto", "Decode slots, or 'auto': the most whose decode state (KV cache, ...) "
    "fits --kv_budget_gb, at most --max_batch_size and the number of requests (rounded up to a "
    "power of two).")
_BUDGET = flags.DEFINE_float(
    "kv_budget_gb", 0.0, "Memory for the decode state with --batch_size=auto; 0: 90% of the "
    "device's free memory where the device reports it, else 2 GiB.")
_MAX_BATCH = flags.DEFINE_integer("max_batch_size", 256, "Upper bound of --batch_size=auto.")
_TEMP = flags.DEFINE_float("temperature", 0.0, "Default temperature (0 = greedy).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Default top-p.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Default top-k (0 = off).")
_PEN = flags.DEFINE_float("repetition_penalty", 1.0, "Default repetition penalty (1 = off).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Default new tokens per request.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed of the job.")
_MAX_LEN = flags.DEFINE_integer(
    "max_len", 0, "Cache length per slot; 0: what the input needs (longest prompt + "
    "max_new_tokens, rounded up to 128), at most the model's context.")
_ATTN = flags.DEFINE_enum("attention", "blocked", ["dense", "blocked"],
                          "Decode attention: dense (every cache position) or blocked (blocks "
                          "up to the longest row).")
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", "auto",
                              ["auto", "float32", "bfloat16", "int8", "float8_e4m3fn"],
                              "KV cache storage (auto: the compute dtype); int8 fits more slots "
                              "in --kv_budget_gb.")
_QUIET = flags.DEFINE_bool("quiet", False, "No progress on stderr.")
flags.mark_flags_as_required(["model", "input", "output"])


def _budget_bytes(params) -> int:
  if _BUDGET.value > 0:
    return int(_BUDGET.value * 2**30)
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
  return 2 * 2**30


def _slots(mcfg, hcfg, dcfg, params, num_requests: int, data: int = 1) -> int:
  """Explicit --batch_size, or the most slots whose decode state fits the budget (per device;
  with a mesh, slots spread over its `data` devices, so the budget is `data` times larger)."""
  if _BATCH.value != "auto":
    try:
      n = int(_BATCH.value)
    except ValueError:
      n = 0
    if n < 1:
      raise ValueError(f"--batch_size={_BATCH.value}: must be 'auto' or a positive integer")
    return n
  fit = engine_lib.max_slots(mcfg, hcfg, dcfg, _budget_bytes(params) * data)
  want = 1 << max(num_requests - 1, 0).bit_length()
  n = max(1, min(fit, want, _MAX_BATCH.value))
  return max(data, n // data * data)


def main(argv):
  del argv
  if not os.path.isfile(_INPUT.value):
    sys.exit(f"mtp-infer: error: input file not found: {_INPUT.value}")
  try:
    mesh_flags.initialize()
    mesh = None if mesh_flags.MESH.value is None else sharding_lib.make_mesh(mesh_flags.MESH.value)
    k = _K.value if _K.value == "auto" else int(_K.value)
    mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(_MODEL.value)
    adaptive = k == "auto"
    max_len = _MAX_LEN.value
    if max_len == 0:
      need = batch.needed_len(_INPUT.value, tok, _MAX_NEW.value) + hcfg.num + 2
      max_len = min(mcfg.max_seq_len, -(-need // 128) * 128)
    dcfg = DecodeConfig(k=-1 if adaptive else k, max_len=max_len, adaptive=adaptive,
                        attention=_ATTN.value, kv_dtype=_KV_DTYPE.value)
    dcfg = dataclasses.replace(
        dcfg, batch_size=_slots(mcfg, hcfg, dcfg, params, batch.count_lines(_INPUT.value),
                                  1 if mesh is None else mesh.shape["data"]))
    dec = api.Decoder(mcfg, hcfg, params, tok, dcfg, seed=_SEED.value, mesh=mesh)
  except (ckpt_lib.ModelDirError, ConfigError, ValueError) as e:
    sys.exit(f"mtp-infer: error: {e}")
  log = None if _QUIET.value else (lambda s: print(s, file=sys.stderr, flush=True))
  if log:
    log(f"mtp-infer: {dec.engine.cfg.batch_size} slots of {dec.engine.cfg.max_len} positions, "
        f"k={_K.value}, "
        f"decode state {engine_lib.state_bytes(mcfg, hcfg, dec.engine.cfg) / 2**20:.0f} MiB")
  if adaptive:
    dec.calibrate(_COSTS.value, force=_CALIBRATE.value)
  defaults = batch.Defaults(_MAX_NEW.value, _TEMP.value, _TOP_P.value, _TOP_K.value, _PEN.value,
                            _SEED.value)
  name = os.path.basename(os.path.normpath(_MODEL.value))
  summary = batch.run_job(dec, _INPUT.value, _OUTPUT.value, defaults, log, model_name=name)
  print(json.dumps(summary), file=sys.stderr)


def run():
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  app.run(main)


if __name__ == "__main__":
  run()
