"""mtp-bench smoke run on the tiny model: every mode, all three outputs, sane values."""

import json
import os
import subprocess
import sys

import pytest

from mtp_jax.bench import benchmark
from tests.helpers import ROOT

FIELDS = ("mode", "batch_size", "tokens_per_s", "acceptance_length", "speedup", "ttft_ms_p50",
          "tpot_ms_p50", "tpot_ms_p99", "host_overhead_us", "roofline_fraction")


@pytest.mark.slow
def test_every_mode_writes_json_table_and_plot(trained_tiny, tmp_path):
  _, workdir, _ = trained_tiny
  model = os.path.join(workdir, "model")
  modes = ["vanilla", "mtp:2", "adaptive", "draft:2", "ngram:2"]
  machine = benchmark.machine_info(roofline=True)
  assert machine["memory_bandwidth_gb_s"] > 0 and machine["matmul_gflop_s"] > 0
  results = benchmark.run(model, modes, [2], max_new_tokens=8, prompt_tokens=16, repeats=1,
                          warmup=0, draft_model=model, machine=machine, log=lambda s: None,
                          cost_table=str(tmp_path / "costs.json"))
  out = tmp_path / "out"
  benchmark.write_outputs(str(out), machine, results, "mtp-bench --test")
  data = json.load(open(out / "results.json"))
  assert data["machine"]["platform"] == machine["platform"]
  assert [(r["mode"], r["batch_size"]) for r in data["results"]] == [(m, 2) for m in modes]
  for r in data["results"]:
    for f in FIELDS:
      assert r[f] is not None, (r["mode"], f)
    assert r["tokens_per_s"] > 0 and r["new_tokens"] > 0
    assert 0 < r["ttft_ms_p50"] and 0 < r["tpot_ms_p50"] <= r["tpot_ms_p99"]
    assert r["acceptance_length"] >= 1.0 and r["compile_s"] > 0 and r["memory_bytes"] > 0
    assert 0 < r["roofline_fraction"] and r["bound"] in ("memory", "compute")
    if r["mode"] == "vanilla":
      assert r["speedup"] == 1.0 and r["acceptance_length"] == 1.0
  # The target drafting for itself accepts (nearly) everything.
  draft = [r for r in data["results"] if r["mode"] == "draft:2"]
  assert min(draft[0]["acceptance_rate_per_position"]) > 0.95, draft
  ad = [r for r in data["results"] if r["mode"] == "adaptive"][0]
  assert ad["best_fixed"] in ("vanilla", "mtp:2") and ad["vs_best"] > 0
  md = (out / "results.md").read_text()
  assert "| draft:2 | 2 |" in md and "mtp-bench --test" in md
  assert f"| adaptive | 2 | {ad['best_fixed']} |" in md
  assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_model_and_prompt_files(tmp_path):
  prompts = tmp_path / "p.jsonl"
  prompts.write_text('{"id": 1, "prompt": "def f(x):\\n    return x\\n"}\n'
                     '{"custom_id": "a", "body": {"prompt": "import os\\n"}}\n')
  res = benchmark.run("config:tiny", ["vanilla", "ngram:2", "control"], [2], max_new_tokens=4,
                      prompt_tokens=8, repeats=2, warmup=0, prompts=str(prompts),
                      log=lambda s: None)
  assert [r.mode for r in res] == ["vanilla", "ngram:2", "control"] and res[0].new_tokens > 0
  # The control is plain decoding in a decoder of its own: the same tokens, a speedup of its
  # own (the two decoders' scatter), set against vanilla's runs like any mode.
  assert res[2].new_tokens == res[0].new_tokens and res[2].acceptance_length == 1.0
  assert res[2].speedup > 0 and res[2].speedup_q25 <= res[2].speedup <= res[2].speedup_q75
  with pytest.raises(ValueError, match="line 1 has no prompt"):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    benchmark.load_prompts(str(bad), None, 2, 8)


def test_cli_rejects_an_unknown_mode():
  r = subprocess.run([sys.executable, "-m", "infer.bench", "--modes=vanilla,fast:3"], cwd=ROOT,
                     capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, PYTHONPATH=ROOT))
  assert r.returncode != 0 and "unknown mode 'fast:3'" in r.stderr


def test_each_attention_and_cache_dtype_is_a_variant_of_every_mode():
  assert benchmark._variants(["vanilla", "mtp:1"], "blocked", "auto") == {
      "vanilla": ("vanilla", "blocked", "auto"), "mtp:1": ("mtp:1", "blocked", "auto")}
  v = benchmark._variants(["vanilla", "mtp:1"], ["dense", "blocked"], ["int8"])
  assert list(v) == ["vanilla dense", "mtp:1 dense", "vanilla blocked", "mtp:1 blocked"]
  assert v["mtp:1 blocked"] == ("mtp:1", "blocked", "int8")


def test_speedup_is_the_median_of_paired_ratios():
  def res(mode, tps):
    return benchmark.Result(mode, 4, tps, 1.0, [], 100, 100 / tps, 10, 1.0, 1.0, 1.0, 1.0, 1.0,
                            1.0, 1, None)
  # The machine's speed drifts between repeats (vanilla 50-100 tokens/s); the mode's paired
  # ratios are 1.1, 1.0, 0.75 (a disturbed run), 1.1 and 1.2.
  van = [res("vanilla", t) for t in (100.0, 50.0, 80.0, 60.0, 90.0)]
  mode = [res("mtp:1", t) for t in (110.0, 50.0, 60.0, 66.0, 108.0)]
  r = benchmark.summarize(mode, van)
  assert r.tokens_per_s == 66.0                        # the repeat of median throughput
  assert abs(r.speedup - 1.1) < 1e-9
  assert abs(r.speedup_q25 - 1.0) < 1e-9 and abs(r.speedup_q75 - 1.1) < 1e-9
  assert mode[3].speedup == 1.0                        # the input rows are not changed
  assert "| 66.0 | 1.10 (1.00-1.10) |" in benchmark.format_row(r)
  v = benchmark.summarize(van, van)
  assert v.speedup == 1.0 and "| 80.0 | 1.00 |" in benchmark.format_row(v)


def test_speedup_compares_each_run_with_vanilla_at_the_same_moment():
  def res(mode, tps, at):
    return benchmark.Result(mode, 4, tps, 1.0, [], 100, 100 / tps, 10, 1.0, 1.0, 1.0, 1.0, 1.0,
                            1.0, 1, None, at_s=at)
  # Three modes in the alternating order V a A | A a V | V a A | A a V, one run a second: the
  # machine slows steadily (vanilla 120 -> 54 tokens/s); every run of A is 1.1x vanilla at its
  # moment, which pairing it with its repeat's vanilla run (two runs away) puts at 0.94-1.34.
  speed = lambda t: 120.0 - 6.0 * t
  van = [res("vanilla", speed(t), t) for t in (0.0, 5.0, 6.0, 11.0)]
  ad = [res("adaptive", 1.1 * speed(t), t) for t in (2.0, 3.0, 8.0, 9.0)]
  r = benchmark.summarize(ad, van)
  assert abs(r.speedup - 1.1) < 1e-9 and abs(r.speedup_q25 - 1.1) < 1e-9
  assert benchmark.summarize(van, van).speedup == 1.0


def test_adaptive_is_set_against_the_best_fixed_shape_at_the_same_moment():
  def res(mode, tps, at):
    return benchmark.Result(mode, 1, tps, 1.0, [], 100, 100 / tps, 10, 1.0, 1.0, 1.0, 1.0, 1.0,
                            1.0, 1, None, at_s=at)
  # Order V m1 m3 n c a | a c n m3 m1 V, one run a second, the machine slowing steadily: mtp:3
  # runs 1.3x vanilla, adaptive 0.97x mtp:3 at every moment, ngram:2 (another drafter) 1.5x.
  speed = lambda t: 100.0 - 2.0 * t
  labels = ["vanilla", "mtp:1", "mtp:3", "ngram:2", "control", "adaptive"]
  # control: plain decoding in a lucky decoder, no shape to set adaptive against.
  factor = {"vanilla": 1.0, "mtp:1": 1.1, "mtp:3": 1.3, "ngram:2": 1.5, "adaptive": 1.3 * 0.97,
            "control": 1.6}
  runs = {m: [] for m in labels}
  t = 0.0
  for rep in range(4):
    for m in (labels if rep % 2 == 0 else labels[::-1]):
      runs[m].append(res(m, factor[m] * speed(t), t))
      t += 1.0
  variants = benchmark._variants(labels, "blocked", "auto")
  rows = {m: benchmark.summarize(runs[m], runs["vanilla"]) for m in labels}
  benchmark.compare_to_best_fixed(rows, runs, variants)
  ad = rows["adaptive"]
  assert ad.best_fixed == "mtp:3" and abs(ad.vs_best - 0.97) < 1e-9
  assert abs(ad.vs_best_q25 - 0.97) < 1e-9 and abs(ad.vs_best_q75 - 0.97) < 1e-9
  assert all(rows[m].vs_best is None for m in labels[:-1])
  table = benchmark.format_vs_best(list(rows.values()))
  assert "| adaptive | 1 | mtp:3 | 0.97 (0.97-0.97) |" in table
  # Without a fixed shape of the heads beside it there is nothing to set it against.
  only = {m: rows[m] for m in ("ngram:2", "adaptive")}
  only["adaptive"] = benchmark.summarize(runs["adaptive"], None)
  benchmark.compare_to_best_fixed(only, runs, benchmark._variants(["ngram:2", "adaptive"],
                                                                  "blocked", "auto"))
  assert only["adaptive"].vs_best is None and benchmark.format_vs_best(list(only.values())) == ""
