#!/usr/bin/env bash
# One-shot accelerator run of mtp-jax: tests on the device, mtp-bench across batch sizes on a
# memory-bound-size model with the demo's real acceptance, then a model of that size trained and
# self-distilled briefly. Writes into $OUT (default out/device):
#   device_run.log   everything printed, with elapsed seconds per stage
#   tests.log        the pytest output of the bf16 / sampling / engine / adaptive tests
#   results.json, results.md, results.png   mtp-bench's tables
#   memory.json      peak device memory of the bench process (jax memory_stats), per run and max
#
#   tools/device_run.sh            on a GPU machine (python3 with jax[cuda], flax, optax, orbax,
#                                  tokenizers, matplotlib; no network): see docs/accelerators.md
#   tools/device_run.sh --smoke    the same stages with a tiny model on this CPU (~2-3 minutes)
#
# Sizing (one 600 s call of the device tool, the machine's start not counted): every stage runs
# under its own `timeout`, so a slow stage is cut and the next still runs. The measurement comes
# first, so that a cut takes the checks that were already made before (tests, training), not it:
#   install 20 s | bench 330 s | graphs 80 s | tests 60 s | train 0 s | distill 0 s  (490 s)
# Each limit is an environment variable (L_INSTALL, L_BENCH, L_GRAPHS, L_TESTS, L_TRAIN,
# L_DISTILL); 0 skips the stage. Training and distillation default to 0: they ran on an H200 on
# 2026-12-04 (docs/accelerators.md); L_TRAIN=60 L_DISTILL=40 measure them again.
# The processes share a persistent XLA compilation cache ($WORK/jax_cache), so plain decoding
# compiles once per batch size although two processes run it (jax keys each program by the XLA
# flags too: the graphs stage compiles its own).
# graphs: the CLIs put the decode loop's `while` and `conditional` into XLA's command buffers
# (CUDA graphs) by default on a GPU (mtp_jax/backend.py); this stage runs batch 1 again without
# them (XLA_FLAGS=--xla_gpu_enable_command_buffer=-WHILE,-CONDITIONAL: the host launching each
# iteration's kernels, 0.87 ms a plain step on the H200 where its weights take ~0.2 ms to read;
# docs/accelerators.md), what the default buys.
# The bench model: `widen:8:pretrained/demo`, the demo widened 8x by a function-preserving
# expansion (mtp_jax/bench/widen.py): d_model 2048, d_ff 5120, 64 heads / 16 kv heads, vocab
# 4096, its 3 heads: 197M parameters. It decodes the demo's tokens, so its acceptance is the
# demo's real one, while a batch-1 step reads its weights (0.79 GB in f32 storage, ~0.2 ms at the H200's
# ~4.3 TB/s) for ~0.4 GFLOP (~1 us of its ~790 TFLOP/s): memory bound, as a real model's batch-1
# step is. Few, wide layers keep XLA's compile time (per engine: 7 modes per batch size) inside
# the bench's limit. Training (after the bench, so that a slow compile there cuts training, not
# the measurement): configs/demo.py widened to d_model 2048, 4 layers, 32 heads (8 kv heads),
# d_ff 5632, bf16: 32 x 512 tokens a step is ~2e13 FLOPs, ~0.1 s at 200 TFLOP/s effective, so
# ~300 steps fit ~30 s after a ~30 s compile; self-distillation 80 steps. This shows training runs
# on the device and how fast; its short run's acceptance is not what the bench measures.
# Override any of these with the environment variables below.
set -uo pipefail

SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/out/$([[ $SMOKE == 1 ]] && echo device_smoke || echo device)}"
mkdir -p "$OUT"
WORK="${WORK:-$(mktemp -d /tmp/mtp_device.XXXXXX)}"
export PYTHONUNBUFFERED=1
# Allocate on demand, so that the allocator's peak is what the program used, not a preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
START=$(date +%s)
exec > >(tee -a "$OUT/device_run.log") 2>&1

say() { echo "[device_run +$(( $(date +%s) - START ))s] $*"; }
stage() {  # stage NAME LIMIT_S CMD...: run under a time limit (0: skip), report how it ended
  local name=$1 limit=$2; shift 2
  if (( limit <= 0 )); then say "stage $name skipped"; return 0; fi
  say "stage $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [[ $rc == 124 || $rc == 137 ]]; then say "stage $name CUT at ${limit}s"
  elif [[ $rc != 0 ]]; then say "stage $name FAILED (rc $rc)"
  else say "stage $name done"; fi
  return $rc
}

if [[ $SMOKE == 1 ]]; then
  PY="${PY:-$REPO/.venv/bin/python}"
  CONFIG=configs/tiny.py
  DISTILL_CONFIG=configs/tiny.py
  MODEL_FLAGS=(--config.data.max_files=40)
  TRAIN_FLAGS=(--config.train.steps=12 --config.train.batch_size=4 --config.train.log_every=4
               --config.train.eval_every=100 --config.train.checkpoint_every=100
               --config.train.eval_batches=1)
  DISTILL_FLAGS=(--config.train.steps=4 --config.train.batch_size=4 --config.train.log_every=2
                 --config.train.eval_every=100 --config.train.checkpoint_every=100
                 --config.train.eval_batches=1 --config.train.distill_prompt_len=16)
  TESTS=(tests/decoding/test_sampling.py)      # the engine / adaptive tests take minutes on 2 cores
  BENCH_MODEL="${BENCH_MODEL:-widen:1:$REPO/pretrained/demo}"
  BATCHES="${BATCHES:-1,2}"
  # Fewer compiles: XLA:CPU takes 10-50 s per engine here.
  MODES="${MODES-vanilla,mtp:2,tree:4}"
  LARGE_MODES="${LARGE_MODES-vanilla,mtp:2}"
  AUTO_MODES="${AUTO_MODES-}"      # adaptive's programs: more compiles on 2 cores
  BENCH_FLAGS=(--max_new_tokens=16 --prompt_tokens=16 --repeats=1 --warmup=0 --roofline=false)
  DEFAULT_LIMITS=(60 300 120 90 120 120)
else
  PY="${PY:-python3}"
  CONFIG=configs/demo.py
  DISTILL_CONFIG=configs/demo_distill.py
  MODEL_FLAGS=(--config.model.d_model=${D_MODEL:-2048} --config.model.n_layers=${LAYERS:-4}
               --config.model.n_heads=${HEADS:-32} --config.model.n_kv_heads=${KV_HEADS:-8}
               --config.model.d_ff=${D_FF:-5632} --config.model.dtype=bfloat16
               --config.data.tokenizer="$REPO/pretrained/demo")
  TRAIN_FLAGS=(--config.train.steps=${TRAIN_STEPS:-300} --config.train.batch_size=32
               --config.data.seq_len=512 --config.train.warmup_steps=40 --config.train.lr=1e-3
               --config.train.eval_every=100000 --config.train.checkpoint_every=100000
               --config.train.log_every=25 --config.train.save_dtype=bfloat16)
  DISTILL_FLAGS=(--config.train.steps=${DISTILL_STEPS:-80} --config.train.batch_size=32
                 --config.train.eval_every=100000 --config.train.checkpoint_every=100000
                 --config.train.log_every=20 --config.train.save_dtype=bfloat16)
  # The bf16 measurement and sampling first: a cut run keeps them.
  TESTS=(tests/decoding/test_bf16.py tests/decoding/test_sampling.py tests/decoding/test_engine.py
         tests/decoding/test_adaptive.py)
  BENCH_MODEL="${BENCH_MODEL:-widen:8:$REPO/pretrained/demo}"
  BATCHES="${BATCHES:-1,64}"
  BENCH_FLAGS=(--max_new_tokens=128 --prompt_tokens=64 --repeats=5)
  DEFAULT_LIMITS=(20 330 80 60 0 0)
fi
# Stage limits in seconds, in the order the stages run; 0 skips a stage.
L_INSTALL=${L_INSTALL:-${DEFAULT_LIMITS[0]}}; L_BENCH=${L_BENCH:-${DEFAULT_LIMITS[1]}}
L_GRAPHS=${L_GRAPHS:-${DEFAULT_LIMITS[2]}}; L_TESTS=${L_TESTS:-${DEFAULT_LIMITS[3]}}
L_TRAIN=${L_TRAIN:-${DEFAULT_LIMITS[4]}}; L_DISTILL=${L_DISTILL:-${DEFAULT_LIMITS[5]}}
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$WORK/jax_cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

say "out=$OUT work=$WORK smoke=$SMOKE python=$PY"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader

# 1. Install: the carried wheels (ml_collections is not on the GPU image) and the package itself,
# without dependencies and without the network; the tree stays first on the path either way.
if [[ $SMOKE == 0 ]]; then
  stage install "$L_INSTALL" bash -c "
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site tools/wheels/*.whl &&
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site ."
  export PYTHONPATH="$REPO:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  say "smoke: using the installed .venv"
fi
$PY - <<'EOF'
import jax, flax, optax, orbax.checkpoint, tokenizers, ml_collections
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "tokenizers", tokenizers.__version__, "devices", jax.devices())
EOF

# 2. The bench: one process per batch size (batch 1 and 64 first: the speedups the product is
# judged by), so that a cut leaves the batch sizes already measured; their tables are merged into
# $OUT/results.{json,md,png} at the end. Batch 1 measures the chains and trees (MODES); larger
# batches, where every draft shape lost on the H200, plain decoding and one draft (LARGE_MODES).
# An empty MODES, LARGE_MODES or AUTO_MODES runs no such process.
# Adaptive k runs in a process of its own beside plain decoding (it compiles shapes as it opens
# them: a cut there must not take the fixed modes' measurements with it); its
# speedup is paired with that process's own plain runs, whose row the merge leaves out.
MODES="${MODES-vanilla,mtp:1,mtp:3,tree:4,tree:16}"
LARGE_MODES="${LARGE_MODES-vanilla,mtp:1}"
AUTO_MODES="${AUTO_MODES-vanilla,adaptive}"
BENCH_END=$(( $(date +%s) + L_BENCH ))
for b in ${BATCHES//,/ }; do
  for kind in fixed auto; do
    modes=$MODES; dir="$WORK/bench_$b"; roof=()
    (( b > 1 )) && modes=$LARGE_MODES
    if [[ $kind == auto ]]; then
      modes=$AUTO_MODES; dir="$WORK/bench_${b}_auto"; roof=(--roofline=false)
    fi
    [[ -z $modes ]] && continue
    left=$(( BENCH_END - $(date +%s) ))
    if (( left < 20 )); then say "bench batch $b ($kind) skipped: ${left}s left"; continue; fi
    stage "bench_b${b}_$kind" "$left" $PY -m infer.bench --model="$BENCH_MODEL" \
      --modes="$modes" --batch_sizes="$b" --out="$dir" "${BENCH_FLAGS[@]}" "${roof[@]}"
  done
done
$PY - "$OUT" "$WORK" "$BENCH_MODEL" "$MODES,$LARGE_MODES,$AUTO_MODES" <<'EOF'
import dataclasses, glob, json, sys
from mtp_jax.bench import benchmark
out, work, model, modes = sys.argv[1:]
results, machine = [], {}
names = {f.name for f in dataclasses.fields(benchmark.Result)}
for path in sorted(glob.glob(f"{work}/bench_*/results.json")):
  d = json.load(open(path))
  machine = d["machine"]
  auto = path.endswith("_auto/results.json")
  results += [benchmark.Result(**{k: v for k, v in r.items() if k in names}) for r in d["results"]
              if not (auto and r["mode"] == "vanilla")]
order = [m for m in dict.fromkeys(modes.split(",")) if m]
results.sort(key=lambda r: (r.batch_size, order.index(r.mode) if r.mode in order else 99))
if results:
  benchmark.write_outputs(out, machine, results,
                          f"tools/device_run.sh: mtp-bench --model={model} "
                          f"--modes={','.join(order)} (adaptive in a process of its own)")
print(f"merged {len(results)} bench rows into {out}")
EOF

# 3. Batch 1 with the decode loop launched from the host (command buffers for WHILE and
# CONDITIONAL off), against the default's CUDA graphs: its own process and table (graphs.md).
XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=-WHILE,-CONDITIONAL" \
  stage graphs "$L_GRAPHS" $PY -m infer.bench \
  --model="$BENCH_MODEL" --modes="${GRAPH_MODES:-vanilla,mtp:3,tree:16}" --batch_sizes=1 \
  --out="$WORK/graphs" --roofline=false "${BENCH_FLAGS[@]}"
cp "$WORK/graphs/results.md" "$OUT/graphs.md" 2>/dev/null

# 4. Peak device memory of the bench's runs (the CPU client reports none: null there).
$PY - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
path = os.path.join(out, "results.json")
rows = json.load(open(path)) if os.path.exists(path) else {}
rows = rows.get("results", rows) if isinstance(rows, dict) else rows
peaks = {f"{r['mode']}@{r['batch_size']}": r.get("peak_device_bytes") for r in rows}
known = [v for v in peaks.values() if v]
summary = {"peak_device_bytes_max": max(known) if known else None, "per_run": peaks,
           "computed_bytes_max": max((r.get("memory_bytes") or 0 for r in rows), default=None)}
json.dump(summary, open(os.path.join(out, "memory.json"), "w"), indent=1)
print("peak device memory (bench):", summary["peak_device_bytes_max"], "bytes; params + "
      "decode state computed:", summary["computed_bytes_max"])
EOF
# 5. Tests on the device (one process: the tiny trained run is shared by the test files).
rm -f "$OUT/tests.log"
stage tests "$L_TESTS" bash -c "$PY -m pytest -q -p no:xdist -p no:cacheprovider -s \
  ${TESTS[*]} > '$OUT/tests.log' 2>&1"
[[ -f "$OUT/tests.log" ]] && grep -E "bf16 greedy|^FAILED|^E " "$OUT/tests.log" | head -30
[[ -f "$OUT/tests.log" ]] && tail -n 3 "$OUT/tests.log"

# 6. Train a model of the bench model's size jointly, then self-distil its heads on its own
# greedy text (each stage logs its step time and losses).
stage train "$L_TRAIN" $PY -m train.main --config=$CONFIG --workdir="$WORK/train" \
  "${MODEL_FLAGS[@]}" "${TRAIN_FLAGS[@]}"
MODEL="$WORK/train/model"
# Same corpus, tokenizer and data config: the distillation reuses the tokenized corpus.
mkdir -p "$WORK/distill" && cp "$WORK"/train/tokens_*.npy "$WORK/distill/" 2>/dev/null
stage distill "$L_DISTILL" $PY -m train.main --config=$DISTILL_CONFIG \
  --workdir="$WORK/distill" --mode=heads_only --config.train.init_from="$MODEL" \
  --config.train.distill_source=generated --config.train.head_loss_stride=1 \
  "${MODEL_FLAGS[@]}" "${DISTILL_FLAGS[@]}"
ls -d "$WORK"/train/model "$WORK"/distill/model 2>/dev/null

say "finished; files in $OUT:"
ls -la "$OUT"
[[ -f "$OUT/results.md" ]] && cat "$OUT/results.md"
