"""mtp-bench's report: the results table (one row per mode and batch size), adaptive k against
the best fixed shape beside it, and the files a run writes (results.json, results.md, results.png).
Rows are Result: one mode at one batch size."""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass
class Result:
  mode: str
  batch_size: int
  tokens_per_s: float
  acceptance_length: float
  acceptance_rate_per_position: list
  new_tokens: int
  seconds: float
  steps: int
  ttft_ms_p50: float
  ttft_ms_p99: float
  tpot_ms_p50: float
  tpot_ms_p99: float
  host_overhead_us: float
  compile_s: float
  memory_bytes: int              # parameters + the decode state (KV caches, buffers, ring)
  peak_device_bytes: int | None  # from the device's allocator, where it reports one
  step_bytes: float = 0.0
  step_flops: float = 0.0
  bandwidth_fraction: float | None = None
  roofline_fraction: float | None = None
  bound: str | None = None
  fits_in_cache: bool | None = None  # CPU: the step's bytes fit the last-level cache, so DRAM
                                     # bandwidth is not its roof (roofline_fraction may exceed 1)
  speedup: float = 1.0            # median over repeats of the ratio to vanilla at the same time
  speedup_q25: float = 1.0
  speedup_q75: float = 1.0
  step_cost: float | None = None  # median over repeats of seconds per step over vanilla's
  at_s: float = 0.0               # the middle of the run, seconds from the batch's first timed run
  best_fixed: str | None = None   # adaptive rows: the fixed shape of highest speedup beside it
  vs_best: float | None = None    # median over repeats of the ratio to best_fixed at the same time
  vs_best_q25: float | None = None
  vs_best_q75: float | None = None
  reused_from: int = 0            # decode.reuse_module: positions from this one (0-based) on
                                  # are drafted by module 1 again (marked *)



HEADER = ("| mode | batch | tokens/s | speedup (IQR) | step cost | acceptance length | "
          "acceptance per position | TTFT p50 ms | TPOT p50/p99 ms | host us/step | roofline | "
          "bound | compile s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(r: Result) -> str:
  per = " ".join(f"{x:.2f}" + ("*" if r.reused_from and i >= r.reused_from else "")
                 for i, x in enumerate(r.acceptance_rate_per_position)) or "-"
  roof = "-" if r.roofline_fraction is None else f"{r.roofline_fraction:.2f}"
  if r.fits_in_cache:
    roof += " (in cache)"
  spread = "" if r.speedup_q25 == r.speedup_q75 else \
      f" ({r.speedup_q25:.2f}-{r.speedup_q75:.2f})"
  cost = "-" if r.step_cost is None else f"{r.step_cost:.2f}"
  return (f"| {r.mode} | {r.batch_size} | {r.tokens_per_s:.1f} | {r.speedup:.2f}{spread} | "
          f"{cost} | {r.acceptance_length:.2f} | {per} | {r.ttft_ms_p50:.1f} | "
          f"{r.tpot_ms_p50:.2f}/{r.tpot_ms_p99:.2f} | {r.host_overhead_us:.0f} | {roof} | "
          f"{r.bound or '-'} | {r.compile_s:.1f} |")


def format_vs_best(results: list[Result]) -> str:
  """Adaptive rows against the best fixed shape beside them (compare_to_best_fixed): a table,
  or '' where no adaptive row has one."""
  rows = [r for r in results if r.vs_best is not None]
  if not rows:
    return ""
  return ("| adaptive | batch | best fixed shape | adaptive / best fixed (IQR) |\n"
          "|---|---|---|---|\n"
          + "\n".join(f"| {r.mode} | {r.batch_size} | {r.best_fixed} | {r.vs_best:.2f} "
                      f"({r.vs_best_q25:.2f}-{r.vs_best_q75:.2f}) |" for r in rows))


def format_tables(results: list[Result]) -> str:
  """The results table, and below it adaptive against the best fixed shape where it has one."""
  vs = format_vs_best(results)
  reused = any(r.reused_from for r in results)
  return (HEADER + "\n" + "\n".join(format_row(r) for r in results)
          + ("\n\n\\* drafted by module 1 reused (the model has fewer MTP modules than drafts)"
             if reused else "") + ("\n\n" + vs if vs else ""))


def write_outputs(out_dir: str, machine: dict, results: list[Result], command: str = ""):
  """results.json, results.md and results.png (throughput and speedup vs batch size)."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump({"machine": machine, "command": command,
               "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    if command:
      f.write(f"`{command}`\n\n")
    f.write(", ".join(f"{k}: {v}" for k, v in machine.items()) + "\n\n")
    f.write(format_tables(results) + "\n")
  plot(results, os.path.join(out_dir, "results.png"))


def plot(results: list[Result], path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for mode in dict.fromkeys(r.mode for r in results):
    rs = sorted((r for r in results if r.mode == mode), key=lambda r: r.batch_size)
    bs = [r.batch_size for r in rs]
    ax1.plot(bs, [r.tokens_per_s for r in rs], marker="o", label=mode)
    ax2.plot(bs, [r.speedup for r in rs], marker="o", label=mode)
  for ax, name in ((ax1, "output tokens/s"), (ax2, "speedup over vanilla")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (concurrent rows)")
    ax.set_ylabel(name)
    ax.grid(True, alpha=0.3)
  ax2.axhline(1.0, color="gray", lw=1, ls="--")
  ax1.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
