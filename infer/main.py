"""mtp-infer: a JSONL file of prompts in, a JSONL file of completions out, decoded speculatively.

  mtp-infer --model=DIR --input=IN.jsonl --output=OUT.jsonl [--k=auto|0..K|tree:T]
            [--batch_size=auto|N] [--kv_budget_gb=G] [--temperature=T] [--top_p=P] [--top_k=K]
            [--max_new_tokens=N] [--seed=S] [--quiet]

Input lines are plain requests or OpenAI batch request lines (mtp_jax/serving/batch.py). Rerunning
with the same --output resumes: ids already written are skipped. Flags are checked before JAX is
imported or the model loaded, so a bad value fails in a moment with one line naming it.
"""

import json
import os
import sys
import time

_T0 = time.perf_counter()    # the process's start, near enough: first_token_s counts from it

from absl import app, flags, logging

from mtp_jax import backend

from infer import checks, mesh_flags
from infer.progress import Progress

_MODEL = flags.DEFINE_string("model", None, "A model directory (or config:NAME: configs/NAME.py "
                             "with random weights; widen:N:DIR: DIR widened N times).")
_INPUT = flags.DEFINE_string("input", None, "JSONL requests.")
_OUTPUT = flags.DEFINE_string("output", None, "JSONL results (appended; resumes).")
_K = flags.DEFINE_string(
    "k", "auto", "Drafts per step: 'auto' (adaptive), -1 all heads, 0 plain, or tree:T: each "
    "step verifies a token tree of T nodes from the parallel heads' top candidates (the model "
    "directory's trees.json, else a default tree).")
_CALIBRATE = flags.DEFINE_bool("calibrate", False, "--k=auto: learn the step costs afresh from "
                               "the roofline, not from those an earlier run stored.")
_COSTS = flags.DEFINE_string("cost_table", None, "JSON where --k=auto keeps the step costs it "
                             "learns and the acceptance runs measured (default: ~/.cache/mtp_jax).")
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
_CHAT_TEMPLATE = flags.DEFINE_string(
    "chat_template", None, "A Jinja2 chat template file for the input's chat lines, in place of "
    "the model's own (chat_template.jinja in the model directory, kept by mtp-import).")
flags.mark_flags_as_required(["model", "input", "output"])


def check_flags():
  """Every flag's value, before anything is loaded: raises checks.FlagError naming the first
  bad one."""
  checks.model_spec("model", _MODEL.value)
  checks.input_file("input", _INPUT.value)
  if _CHAT_TEMPLATE.value is not None:
    checks.input_file("chat_template", _CHAT_TEMPLATE.value)
  checks.output_file("output", _OUTPUT.value)
  if _COSTS.value:
    checks.output_file("cost_table", _COSTS.value)
  checks.k_spec("k", _K.value, lo=-1)
  checks.int_or_auto("batch_size", _BATCH.value, lo=1)
  checks.number("kv_budget_gb", _BUDGET.value, lo=0)
  checks.number("max_batch_size", _MAX_BATCH.value, lo=1)
  checks.number("temperature", _TEMP.value, lo=0)
  checks.number("top_p", _TOP_P.value, lo=0, lo_open=True, hi=1)
  checks.number("top_k", _TOP_K.value, lo=0)
  checks.number("repetition_penalty", _PEN.value, lo=0, lo_open=True)
  checks.number("max_new_tokens", _MAX_NEW.value, lo=1)
  checks.number("seed", _SEED.value, lo=0, hi=2**31 - 1)
  checks.number("max_len", _MAX_LEN.value, lo=0)


def _budget_bytes(params) -> int:
  import jax
  if _BUDGET.value > 0:
    return int(_BUDGET.value * 2**30)
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
  return 2 * 2**30


def _slots(mcfg, hcfg, dcfg, params, num_requests: int, data: int = 1) -> int:
  """Explicit --batch_size, or the most slots whose decode state fits the budget (per device;
  with a mesh, slots spread over its `data` devices, so the budget is `data` times larger)."""
  from mtp_jax.decoding import memory
  if _BATCH.value != "auto":
    return int(_BATCH.value)
  fit = memory.max_slots(mcfg, hcfg, dcfg, _budget_bytes(params) * data)
  want = 1 << max(num_requests - 1, 0).bit_length()
  n = max(1, min(fit, want, _MAX_BATCH.value))
  return max(data, n // data * data)


def _decoder():
  """Loads the model and builds the decoder the job's input needs."""
  import dataclasses

  from mtp_jax import sharding as sharding_lib
  from mtp_jax.config import DecodeConfig
  from mtp_jax.decoding import shapes
  from mtp_jax.formats import chat
  from mtp_jax.formats import checkpoint as ckpt_lib
  from mtp_jax.serving import api, batch
  mesh_flags.initialize()
  mesh = None if mesh_flags.MESH.value is None else sharding_lib.make_mesh(mesh_flags.MESH.value)
  if _MODEL.value.startswith(("config:", "widen:")):   # random or widened weights: speed only
    from mtp_jax.bench import benchmark
    mcfg, hcfg, params, tok = benchmark.load_model(_MODEL.value)
  else:
    mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(_MODEL.value)
  if _CHAT_TEMPLATE.value:
    with open(_CHAT_TEMPLATE.value, encoding="utf-8") as f:
      tok.chat_template = chat.check_template(f.read(), _CHAT_TEMPLATE.value)
  budget = shapes.tree_budget(_K.value)
  tree = None if budget is None else shapes.tree_for(budget, hcfg.num, _MODEL.value)
  k = -1 if tree is not None else _K.value if _K.value == "auto" else int(_K.value)
  adaptive = k == "auto"
  max_len = _MAX_LEN.value
  if max_len == 0:         # a step's inputs past the last token: the heads, or a tree's nodes
    span = hcfg.num if tree is None else tree.size
    need = batch.needed_len(_INPUT.value, tok, _MAX_NEW.value) + span + 2
    max_len = min(mcfg.max_seq_len, -(-need // 128) * 128)
  dcfg = DecodeConfig(k=-1 if adaptive else k, max_len=max_len, adaptive=adaptive,
                      attention=_ATTN.value, kv_dtype=_KV_DTYPE.value,
                      tree=() if tree is None else tree.choices)
  dcfg = dataclasses.replace(
      dcfg, batch_size=_slots(mcfg, hcfg, dcfg, params, batch.count_lines(_INPUT.value),
                              1 if mesh is None else mesh.shape["data"]))
  return api.Decoder(mcfg, hcfg, params, tok, dcfg, seed=_SEED.value, mesh=mesh)


def _progress_callback(quiet: bool):
  """run_job's progress callback: a bar of rows with tokens/s and acceptance length."""
  import time
  state = {"bar": None, "t0": time.perf_counter()}

  def progress(counts, total):
    if state["bar"] is None:
      state["bar"] = Progress(total, "rows", quiet=quiet, desc="mtp-infer")
      state["t0"] = time.perf_counter()
    el = max(time.perf_counter() - state["t0"], 1e-9)
    acc = (counts["tokens"] - counts["completed"]) / max(counts["decode_steps"], 1)
    state["bar"].update(counts["completed"], tokens_per_s=counts["tokens"] / el,
                        acceptance_length=acc)
  return progress, state


def main(argv):
  del argv
  try:
    check_flags()
  except checks.FlagError as e:
    sys.exit(f"mtp-infer: error: {e}")
  from mtp_jax.decoding import memory
  from mtp_jax.formats import cache_dir
  from mtp_jax.formats import checkpoint as ckpt_lib
  from mtp_jax.serving import batch
  cache_dir.enable_compilation_cache()          # a second run loads its programs, not compiles
  from mtp_jax.config import ConfigError
  say = (lambda s: None) if _QUIET.value else (lambda s: print(s, file=sys.stderr, flush=True))
  try:
    dec = _decoder()
  except (ckpt_lib.ModelDirError, ConfigError, ValueError) as e:
    sys.exit(f"mtp-infer: error: {e}")
  eng = dec.engine
  say(f"mtp-infer: {eng.cfg.batch_size} slots of {eng.cfg.max_len} positions, k={_K.value}, "
      f"decode state {memory.state_bytes(eng.model_cfg, eng.heads_cfg, eng.cfg) / 2**20:.0f}"
      " MiB")
  dec.cost_table(_COSTS.value, fresh=_CALIBRATE.value)
  defaults = batch.Defaults(_MAX_NEW.value, _TEMP.value, _TOP_P.value, _TOP_K.value, _PEN.value,
                            _SEED.value)
  name = os.path.basename(os.path.normpath(_MODEL.value))
  progress, state = _progress_callback(_QUIET.value)
  summary = batch.run_job(dec, _INPUT.value, _OUTPUT.value, defaults, progress, model_name=name,
                          t0=_T0)
  if state["bar"] is not None:
    state["bar"].close()
  say(json.dumps(summary))


def run():
  backend.apply_defaults()            # before JAX starts a backend
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads at INFO
  app.run(main, flags_parser=checks.flags_parser("mtp-infer"))


if __name__ == "__main__":
  run()
