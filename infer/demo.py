"""`make demo`: what speculative decoding with the model's MTP heads buys, measured side by side.

  python -m infer.demo [--model=pretrained/demo] [--k=3] [--repeats=11] [--widen=2]
                       [--batch_size=16]

1. One stream (one slot: a person waiting for a completion): the prompts of --prompts (openings
   of standard-library functions the demo model's data split held out) decoded greedily with k
   drafts per step and plainly. After an untimed run each, --repeats timed runs alternate between
   the two (in swapped order every other repeat), and the speedup is the median of the paired
   time ratios. The tokens must be identical. Then the same with the model widened --widen times
   (mtp_jax/bench/widen.py: the same function and tokens, widen^2 times the weights): the demo's
   15 MB sit in this CPU's cache, where a step of k+1 tokens costs ~2.5 plain steps, while a real
   model's step streams its weights from memory, as the widened one's does, and verifying k+1
   tokens then costs little more than one.
2. A batch job (mtp-infer's code path: batch.run_job) over --batch_prompts at --batch_size slots,
   where on a CPU drafting costs nearly as much as it saves: --k=auto against plain decoding,
   alternating the same way; adaptive k should hold at or above plain.
3. A sampled completion (temperature, top-p, repetition penalty) beside the greedy one: greedy
   decoding of a 4M-parameter model soon repeats itself.
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags, logging

from mtp_jax import backend

from infer import checks

_MODEL = flags.DEFINE_string("model", "pretrained/demo", "A model directory.")
_PROMPTS = flags.DEFINE_string("prompts", "infer/demo_prompts.jsonl", "Single-stream prompts.")
_BATCH_PROMPTS = flags.DEFINE_string("batch_prompts", "infer/demo_batch.jsonl",
                                     "Prompts of the batch job (mtp-infer's input form).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 192, "Tokens per single-stream completion.")
_BATCH_MAX_NEW = flags.DEFINE_integer("batch_max_new_tokens", 96, "Tokens per batch-job row.")
_K = flags.DEFINE_integer("k", 3, "Drafts per step of the single-stream speculative decoder.")
_REPEATS = flags.DEFINE_integer("repeats", 11, "Timed single-stream runs of each decoder.")
_WIDEN = flags.DEFINE_integer("widen", 2, "One stream again with the model widened this many "
                               "times (the same tokens, bound by memory); 0 or 1 skips it.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Slots of the batch job.")
_BATCH_REPEATS = flags.DEFINE_integer("batch_repeats", 9, "Timed batch jobs of each decoder.")
_OUT = flags.DEFINE_string("out", "out", "Directory for the batch jobs' outputs.")

_T0 = time.perf_counter()


def say(msg: str):
  print(f"[{time.perf_counter() - _T0:4.0f}s] {msg}", flush=True)


def _prompts(path: str) -> list[dict]:
  return [json.loads(line) for line in open(path) if line.strip()]


def _clip(text: str, lines: int = 10) -> str:
  """The first lines of a completion: enough to read, not a screenful."""
  kept = text.split("\n")
  return "\n".join(kept[:lines]) + (" [...]" if len(kept) > lines else "")


def _tokens_per_step(outs) -> float:
  """Tokens a row gets per decode step (the first token comes from prefill), as mtp-infer
  reports it."""
  return sum(len(o.token_ids) - 1 for o in outs) / max(sum(o.steps for o in outs), 1)


def _spread(ratios: list[float]) -> tuple[float, float, float]:
  """(median, lower quartile, upper quartile) of paired ratios."""
  q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
  return statistics.median(ratios), q[0], q[-1]


def _timed(dec, reqs):
  t0 = time.perf_counter()
  outs = dec.run(reqs)
  return outs, time.perf_counter() - t0


def single_stream(model: str, prompts: list[str], max_len: int, widen: int = 0):
  """-> (rows of the table, the speculative decoder, its greedy completions). widen > 1: the
  model widened that many times (benchmark.load_model's 'widen:N:DIR')."""
  from mtp_jax.bench import benchmark
  from mtp_jax.config import DecodeConfig
  from mtp_jax.serving import api
  loaded = benchmark.load_model(f"widen:{widen}:{model}" if widen > 1 else model)
  make = lambda k: api.Decoder(*loaded, DecodeConfig(batch_size=1, k=k, max_len=max_len))
  spec, plain = make(_K.value), make(0)
  reqs = [api.Request(spec.tokenizer.encode(p), _MAX_NEW.value) for p in prompts]
  tag = f", widened x{widen}" if widen > 1 else ""
  what = "one stream" + tag
  say(f"{what}: compiling, then a warm-up run of each decoder over {len(prompts)} prompts")
  _timed(spec, reqs)
  _timed(plain, reqs)
  say(f"{what}: {_REPEATS.value} alternating timed runs of each")
  times = {"spec": [], "plain": []}
  same = True
  for r in range(_REPEATS.value):
    for name in (("spec", "plain") if r % 2 == 0 else ("plain", "spec")):
      outs, dt = _timed(spec if name == "spec" else plain, reqs)
      times[name].append(dt)
      if name == "spec":
        spec_outs = outs
      else:
        plain_outs = outs
    same &= all(a.token_ids == b.token_ids for a, b in zip(spec_outs, plain_outs))
  tokens = sum(len(o.token_ids) for o in spec_outs)
  ratio = _spread([p / s for p, s in zip(times["plain"], times["spec"])])
  rows = [(f"plain greedy{tag}", 1, tokens / statistics.median(times["plain"]), 1.0, None, None),
          (f"speculative, k={spec.engine.kd}{tag}", 1,
           tokens / statistics.median(times["spec"]), _tokens_per_step(spec_outs), ratio, same)]
  return rows, spec, spec_outs


def _job(dec, inp: str, out: str):
  from mtp_jax.serving import batch
  for path in (out, out + ".summary.json"):
    if os.path.exists(path):
      os.remove(path)
  summary = batch.run_job(dec, inp, out, batch.Defaults(max_new_tokens=_BATCH_MAX_NEW.value))
  with open(out) as f:
    texts = {r["id"]: r["text"] for r in map(json.loads, f)}
  return summary, texts


def batch_job(model: str, inp: str, max_len: int):
  """Plain decoding and --k=auto as batch jobs over the same input, alternating."""
  from mtp_jax.serving import api
  os.makedirs(_OUT.value, exist_ok=True)
  n = _BATCH.value
  plain = api.Decoder.load(model, batch_size=n, k=0, max_len=max_len)
  auto = api.Decoder.load(model, batch_size=n, k="auto", max_len=max_len)
  say(f"batch job, {n} slots, --k=auto (step costs learned while decoding; kept in "
      "~/.cache/mtp_jax)")
  auto.cost_table()
  decs = {"plain": plain, "auto": auto}
  outs = {name: os.path.join(_OUT.value, f"demo_batch.{name}.jsonl") for name in decs}
  say(f"batch job: compiling, then a warm-up job of each decoder over "
      f"{len(_prompts(inp))} prompts")
  for name in decs:
    _job(decs[name], inp, outs[name])
  say(f"batch job: {_BATCH_REPEATS.value} alternating timed jobs of each")
  runs = {"plain": [], "auto": []}
  for r in range(_BATCH_REPEATS.value):
    for name in (("auto", "plain") if r % 2 == 0 else ("plain", "auto")):
      runs[name].append(_job(decs[name], inp, outs[name]))
  tps = {k: [s["tokens_per_s"] for s, _ in v] for k, v in runs.items()}
  ratio = _spread([a / p for a, p in zip(tps["auto"], tps["plain"])])
  same = all(a[1] == p[1] for a, p in zip(runs["auto"], runs["plain"]))
  acc = statistics.median(s["acceptance_length"] for s, _ in runs["auto"])
  return [("plain greedy, batch job", n, statistics.median(tps["plain"]), 1.0, None, None),
          ("--k=auto, batch job", n, statistics.median(tps["auto"]), acc, ratio, same)]


def sampled_example(spec, prompt: str, greedy_text: str):
  say("sampling: temperature 0.8, top-p 0.95, repetition penalty 1.3 (compiles the sampled step)")
  c = spec.generate([prompt], max_new_tokens=_MAX_NEW.value, temperature=0.8, top_p=0.95,
                    repetition_penalty=1.3, seed=1)[0]
  bold = lambda s: f"\x1b[1m{s}\x1b[0m" if sys.stdout.isatty() else s
  print("-" * 72 + f"\n(greedy)\n{prompt}{bold(_clip(greedy_text))}\n" + "-" * 72
        + "\n(the same prompt, sampled)\n" + f"{prompt}{bold(_clip(c.text))}\n" + "-" * 72)


def table(rows) -> str:
  head = (f"{'mode':<38} {'slots':>5} {'tokens/s':>9} {'tokens/step':>11} "
          f"{'speedup (IQR)':>19} identical")
  lines = [head, "-" * len(head)]
  for mode, slots, tps, tpstep, ratio, same in rows:
    lines.append(f"{mode:<38} {slots:>5} {tps:>9,.0f} {tpstep:>11.2f} "
                 f"{'-' if ratio is None else '%.2fx (%.2f-%.2f)' % ratio:>19} "
                 f"{'-' if same is None else 'yes' if same else 'NO'}")
  return "\n".join(lines)


def main(argv):
  del argv
  try:
    checks.model_dir("model", _MODEL.value)
    checks.input_file("prompts", _PROMPTS.value)
    checks.input_file("batch_prompts", _BATCH_PROMPTS.value)
    for name, flag in (("repeats", _REPEATS), ("batch_repeats", _BATCH_REPEATS),
                       ("batch_size", _BATCH), ("max_new_tokens", _MAX_NEW),
                       ("batch_max_new_tokens", _BATCH_MAX_NEW), ("k", _K)):
      checks.number(name, flag.value, lo=1)
    checks.number("widen", _WIDEN.value, lo=0)
    checks.output_dir("out", _OUT.value)
  except checks.FlagError as e:
    sys.exit(f"mtp-demo: error: {e}")
  from mtp_jax.formats import cache_dir
  from mtp_jax.formats import checkpoint as ckpt_lib
  cache_dir.enable_compilation_cache()          # a second run loads its programs, not compiles
  say(f"loading {_MODEL.value}")
  mcfg, hcfg, _, tok = ckpt_lib.load_model_dir(_MODEL.value)
  prompts = [p["prompt"] for p in _prompts(_PROMPTS.value)]

  def max_len(path, max_new):
    """The cache a row can reach, rounded up as mtp-infer rounds it."""
    longest = max(len(tok.encode(p["prompt"])) for p in _prompts(path))
    return min(mcfg.max_seq_len, -(-(longest + max_new + hcfg.num + 2) // 128) * 128)

  rows, spec, outs = single_stream(_MODEL.value, prompts, max_len(_PROMPTS.value, _MAX_NEW.value))
  for p, o in zip(prompts[1:3], outs[1:3]):
    print("-" * 72 + f"\n(greedy, {_tokens_per_step([o]):.2f} tokens a step)\n{p}{_clip(o.text)}")
  sampled_example(spec, prompts[0], outs[0].text)
  if _WIDEN.value > 1:
    rows += single_stream(_MODEL.value, prompts, max_len(_PROMPTS.value, _MAX_NEW.value),
                          _WIDEN.value)[0]
  rows += batch_job(_MODEL.value, _BATCH_PROMPTS.value,
                    max_len(_BATCH_PROMPTS.value, _BATCH_MAX_NEW.value))
  print("\n" + table(rows))
  print(f"\ntokens/s: median of the timed runs; speedup: median ratio to plain decoding in "
        f"alternating runs (interquartile range); tokens/step: tokens a row gets per decode step. "
        f"{time.perf_counter() - _T0:.0f}s in all.\nTimings scatter by ~10% on a busy or shared "
        "CPU; the same batch job from the command line:\n  mtp-infer --model=pretrained/demo "
        f"--input={_BATCH_PROMPTS.value} --output=out/batch.jsonl --k=auto "
        f"--batch_size={_BATCH.value} --max_new_tokens={_BATCH_MAX_NEW.value}")
  if not all(r[5] is not False for r in rows):
    sys.exit("mtp-demo: error: speculative output differs from plain greedy decoding")


if __name__ == "__main__":
  backend.apply_defaults()              # before JAX starts a backend
  logging.set_verbosity(logging.WARNING)
  app.run(main, flags_parser=checks.flags_parser("mtp-demo"))
