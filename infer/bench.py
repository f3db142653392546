"""mtp-bench: plain vs MTP vs draft-model vs prompt-lookup decoding across batch sizes, side by
side in one run, with latency percentiles, host overhead, a roofline and a plot.

  mtp-bench --model=pretrained/demo --modes=vanilla,mtp:3,adaptive,draft:3,ngram:3 \
            --batch_sizes=1,8,64 --max_new_tokens=128 --out=bench_out
  mtp-bench --model=config:bench_large --modes=vanilla,mtp:3 --batch_sizes=1,8   # random weights

Writes OUT/results.json ({"machine": ..., "results": [...]}), OUT/results.md and OUT/results.png;
the table is also printed. See mtp_jax/benchmark.py for what each column measures and how.
"""

import shlex
import sys

from absl import app, flags, logging

from infer import mesh_flags
from mtp_jax import benchmark
from mtp_jax import checkpoint as ckpt_lib

_MODEL = flags.DEFINE_string("model", "pretrained/demo",
                             "A model directory, or config:NAME (configs/NAME.py, random weights).")
_MODES = flags.DEFINE_list("modes", ["vanilla", "mtp:1", "mtp:2", "mtp:3", "adaptive"],
                           "vanilla | mtp:K | adaptive | draft:K | ngram:K")
_DRAFT = flags.DEFINE_string("draft_model", "pretrained/draft", "Draft model of draft:K modes.")
_BATCH = flags.DEFINE_list("batch_sizes", ["1", "8"], "Slot counts to measure.")
_PROMPTS = flags.DEFINE_string(
    "prompts", "", "A JSONL file in mtp-infer's input form or a directory of source files "
    "(default: held-out standard-library code).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 64, "Prompt length in tokens.")
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Prompts per slot (continuous batching refills).")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed runs per mode after compiling.")
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "Timed repeats per mode, interleaved across modes: the repeat of median "
    "throughput is reported, the speedup is the median of per-repeat ratios to vanilla.")
_TEMP = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
# The choices of DecodeConfig.attention / kv_dtype, spelled out so that flags are checked
# before JAX is imported.
_ATTN = flags.DEFINE_enum("attention", "blocked", ["dense", "blocked"],
                          "Decode attention: dense (every cache position) or blocked (blocks "
                          "up to the longest row).")
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", "auto",
                              ["auto", "float32", "bfloat16", "int8", "float8_e4m3fn"],
                              "KV cache storage (auto: the compute dtype).")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "Cache length per slot; 0: what the prompts and "
                                "new tokens need.")
_ROOF = flags.DEFINE_bool("roofline", True, "Measure bandwidth and matmul throughput.")
_OUT = flags.DEFINE_string("out", "", "Directory for results.json, results.md, results.png.")


def main(argv):
  try:
    for m in _MODES.value:
      benchmark.parse_mode(m)
    sizes = [int(b) for b in _BATCH.value]
    if min(sizes) < 1:
      raise ValueError(f"--batch_sizes={_BATCH.value}: must be positive")
  except ValueError as e:
    sys.exit(f"mtp-bench: error: {e}")
  mesh_flags.initialize()
  machine = benchmark.machine_info(_ROOF.value)
  print(", ".join(f"{k}: {v}" for k, v in machine.items()), flush=True)
  print(benchmark.HEADER, flush=True)
  try:
    results = benchmark.run(
        _MODEL.value, _MODES.value, sizes, _MAX_NEW.value, _PROMPT.value, _ROUNDS.value,
        _REPEATS.value, _WARMUP.value, _TEMP.value, _PROMPTS.value,
        _DRAFT.value if any(m.startswith("draft:") for m in _MODES.value) else "", machine,
        log=lambda s: print(s, flush=True), mesh=mesh_flags.MESH.value,
        attention=_ATTN.value, kv_dtype=_KV_DTYPE.value, max_len=_MAX_LEN.value)
  except (ckpt_lib.ModelDirError, ValueError) as e:
    sys.exit(f"mtp-bench: error: {e}")
  if _OUT.value:
    command = "mtp-bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    benchmark.write_outputs(_OUT.value, machine, results, command)
    print(f"wrote {_OUT.value}/results.json, results.md, results.png", flush=True)


def run():
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  app.run(main)


if __name__ == "__main__":
  run()
