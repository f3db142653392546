"""mtp-bench: plain vs MTP vs draft-model vs prompt-lookup decoding across batch sizes, side by
side in one run, with latency percentiles, host overhead, a roofline and a plot.

  mtp-bench --model=pretrained/demo --modes=vanilla,mtp:3,adaptive,draft:3,ngram:3 \
            --batch_sizes=1,8,64 --max_new_tokens=128 --out=bench_out
  mtp-bench --model=config:bench_large --modes=vanilla,mtp:3 --batch_sizes=1,8   # random weights
  mtp-bench --model=pretrained/demo --modes=vanilla,mtp:3,tree:8,tree:16 --batch_sizes=1,8

Writes OUT/results.json ({"machine": ..., "results": [...]}), OUT/results.md and OUT/results.png;
the table is printed when the run ends (rows also as each batch size finishes, with a progress
bar on a terminal, on stderr; the roofline columns, probed after the runs, only in the final
table). Flags are checked before any model is loaded. See mtp_jax/bench/benchmark.py for what each
column measures and how.
"""

import shlex
import sys

from absl import app, flags, logging

from mtp_jax import backend

from infer import checks, mesh_flags
from infer.progress import Progress
from mtp_jax.bench import modes

_MODEL = flags.DEFINE_string("model", "pretrained/demo",
                             "A model directory, or config:NAME (configs/NAME.py, random weights).")
_MODES = flags.DEFINE_list("modes", ["vanilla", "mtp:1", "mtp:2", "mtp:3", "adaptive"],
                           "vanilla | mtp:K | adaptive | draft:K | ngram:K | tree:T (a token "
                           "tree of T nodes from the heads' top candidates) | control (plain "
                           "decoding in a second decoder: the speedups' floor)")
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
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set of tokens whose "
                            "probability reaches this (1 = off; with --temperature > 0).")
# The choices of DecodeConfig.attention / kv_dtype, spelled out so that flags are checked
# before JAX is imported.
_ATTENTIONS = ("dense", "blocked")
_KV_DTYPES = ("auto", "float32", "bfloat16", "int8", "float8_e4m3fn")
_ATTN = flags.DEFINE_list("attention", ["blocked"],
                          "Decode attention: dense (every cache position) or blocked (blocks "
                          "up to the longest row); several: every mode runs with each, side by "
                          "side.")
_KV_DTYPE = flags.DEFINE_list("kv_dtype", ["auto"],
                              f"KV cache storage, one or more of {', '.join(_KV_DTYPES)} (auto: "
                              "the compute dtype); several: every mode runs with each.")
_MAX_LEN = flags.DEFINE_integer("max_len", 0, "Cache length per slot; 0: what the prompts and "
                                "new tokens need.")
_ROOF = flags.DEFINE_bool("roofline", True, "Measure bandwidth and matmul throughput.")
_OUT = flags.DEFINE_string("out", "", "Directory for results.json, results.md, results.png.")
_QUIET = flags.DEFINE_bool("quiet", False, "No progress on stderr; only the final table.")


def check_flags() -> list[int]:
  """Every flag's value, before anything is loaded (raises checks.FlagError) -> batch sizes."""
  if not _MODES.value:
    raise checks.FlagError("--modes=: must list at least one mode")
  for m in _MODES.value:
    try:
      modes.parse_mode(m)
    except ValueError as e:
      raise checks.FlagError(f"--modes={','.join(_MODES.value)}: {e}") from None
  sizes = checks.int_list("batch_sizes", _BATCH.value, lo=1)
  checks.model_spec("model", _MODEL.value)
  if any(m.startswith("draft:") for m in _MODES.value):
    checks.model_dir("draft_model", _DRAFT.value)
  for name, flag, allowed in (("attention", _ATTN, _ATTENTIONS),
                              ("kv_dtype", _KV_DTYPE, _KV_DTYPES)):
    bad = [v for v in flag.value if v not in allowed] or ([] if flag.value else [""])
    if bad:
      raise checks.FlagError(f"--{name}={','.join(flag.value)}: unknown value {bad[0]!r} "
                             f"(expected one or more of {', '.join(allowed)})")
  checks.prompts_spec("prompts", _PROMPTS.value)
  if _OUT.value:
    checks.output_dir("out", _OUT.value)
  for name, flag, lo in (("max_new_tokens", _MAX_NEW, 1), ("prompt_tokens", _PROMPT, 1),
                         ("rounds", _ROUNDS, 1), ("warmup", _WARMUP, 0),
                         ("repeats", _REPEATS, 1), ("temperature", _TEMP, 0),
                         ("max_len", _MAX_LEN, 0)):
    checks.number(name, flag.value, lo=lo)
  if not 0 < _TOP_P.value <= 1:
    raise checks.FlagError(f"--top_p={_TOP_P.value}: must be in (0, 1]")
  return sizes


def main(argv):
  del argv
  try:
    sizes = check_flags()
  except checks.FlagError as e:
    sys.exit(f"mtp-bench: error: {e}")
  from mtp_jax.bench import benchmark
  from mtp_jax.formats import checkpoint as ckpt_lib
  mesh_flags.initialize()
  say = (lambda s: None) if _QUIET.value else (lambda s: print(s, file=sys.stderr, flush=True))
  # The roofs are probed after the runs: the accelerator's probe allocates 4 GiB, which would
  # otherwise be every run's peak device memory.
  machine = benchmark.machine_info(roofline=False)
  say(", ".join(f"{k}: {v}" for k, v in machine.items()))
  bar = None

  def progress(done, total, what):
    nonlocal bar
    if bar is None:
      bar = Progress(total, "runs", quiet=_QUIET.value, desc="mtp-bench")
    bar.update(done, last=what)

  log = lambda s: bar.write(s) if bar is not None else say(s)
  try:
    results = benchmark.run(
        _MODEL.value, _MODES.value, sizes, _MAX_NEW.value, _PROMPT.value, _ROUNDS.value,
        _REPEATS.value, _WARMUP.value, _TEMP.value, _PROMPTS.value,
        _DRAFT.value if any(m.startswith("draft:") for m in _MODES.value) else "", machine,
        log=log, mesh=mesh_flags.MESH.value, attention=_ATTN.value, kv_dtype=_KV_DTYPE.value,
        max_len=_MAX_LEN.value, progress=progress, top_p=_TOP_P.value)
  except (ckpt_lib.ModelDirError, ValueError) as e:
    sys.exit(f"mtp-bench: error: {e}")
  finally:
    if bar is not None:
      bar.close()
  if _ROOF.value:
    machine.update(benchmark.roofs(machine["platform"]))
    say(", ".join(f"{k}: {v}" for k, v in machine.items() if k.endswith("_s")))
    for r in results:
      benchmark.place_on_roofline(r, machine)
  print(benchmark.format_tables(results), flush=True)
  if _OUT.value:
    command = "mtp-bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    benchmark.write_outputs(_OUT.value, machine, results, command)
    print(f"wrote {_OUT.value}/results.json, results.md, results.png", flush=True)


def run():
  backend.apply_defaults()            # before JAX starts a backend
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  app.run(main, flags_parser=checks.flags_parser("mtp-bench"))


if __name__ == "__main__":
  run()
