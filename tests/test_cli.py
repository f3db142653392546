"""Bad command lines fail fast: each CLI, given a bad flag value, exits non-zero with one line on
stderr naming the flag and the value, writes nothing and loads no model. mtp-infer and
mtp-bench run with a `jax` on the path that cannot be imported, so a check that comes after
loading anything fails the test; mtp-train's config files import the library, so there the
test checks that no run directory content was written."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

MODEL = os.path.join(ROOT, "pretrained", "demo")
PROMPTS = os.path.join(ROOT, "infer", "demo_prompts.jsonl")


@pytest.fixture(scope="module")
def no_jax(tmp_path_factory):
  """A PYTHONPATH entry whose `jax` refuses to import."""
  d = tmp_path_factory.mktemp("nojax")
  (d / "jax").mkdir()
  (d / "jax" / "__init__.py").write_text("raise ImportError('jax was imported')\n")
  return str(d)


def _run(module, args, pythonpath):
  r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                     text=True, timeout=120, env=dict(os.environ, PYTHONPATH=pythonpath))
  lines = r.stderr.strip().splitlines()
  assert r.returncode != 0, r.stderr
  assert len(lines) == 1, r.stderr
  return lines[0]


def _infer(tmp_path, no_jax, **flags):
  args = {"model": MODEL, "input": PROMPTS, "output": str(tmp_path / "out.jsonl"), **flags}
  return _run("infer.main", [f"--{k}={v}" for k, v in args.items() if v is not None],
              f"{no_jax}{os.pathsep}{ROOT}")


@pytest.mark.parametrize("flags, expected", [
    ({"output": "/no/such/dir/out.jsonl"}, "--output=/no/such/dir/out.jsonl: directory"),
    ({"temperature": "-1"}, "--temperature=-1.0: must be >= 0"),
    ({"top_p": "0"}, "--top_p=0.0: must be > 0 and <= 1"),
    ({"top_p": "1.5"}, "--top_p=1.5: must be > 0 and <= 1"),
    ({"top_k": "-2"}, "--top_k=-2: must be >= 0"),
    ({"repetition_penalty": "0"}, "--repetition_penalty=0.0: must be > 0"),
    ({"max_new_tokens": "0"}, "--max_new_tokens=0: must be >= 1"),
    ({"batch_size": "0"}, "--batch_size=0: must be 'auto' or an integer >= 1"),
    ({"k": "three"}, "--k=three: must be 'auto' or an integer >= -1"),
    ({"input": None}, "--input"),
    ({"input": "/no/such/prompts.jsonl"}, "--input=/no/such/prompts.jsonl: no such file"),
    ({"model": "/no/such/model"}, "--model=/no/such/model: no such directory"),
    ({"temperature": "warm"}, "--temperature=warm"),
])
def test_infer_bad_flag(tmp_path, no_jax, flags, expected):
  line = _infer(tmp_path, no_jax, **flags)
  assert line.startswith(("mtp-infer: error: ", "FATAL Flags parsing error: ")), line
  assert expected in line
  assert not os.path.exists(tmp_path / "out.jsonl")


def test_infer_empty_prompt_file(tmp_path, no_jax):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n  \n")
  line = _infer(tmp_path, no_jax, input=str(empty))
  assert f"--input={empty}: the file holds no requests" in line
  assert not os.path.exists(tmp_path / "out.jsonl")


@pytest.mark.parametrize("flags, expected", [
    (["--modes=vanilla,fast:3"], "--modes=vanilla,fast:3: unknown mode 'fast:3'"),
    (["--batch_sizes=0,8"], "--batch_sizes=0,8: every value must be >= 1"),
    (["--batch_sizes=one"], "--batch_sizes=one: must be a comma-separated list of integers"),
    (["--out=/etc/hostname/results"], "--out=/etc/hostname/results: /etc/hostname is not a dir"),
    (["--model=/no/such/model"], "--model=/no/such/model: no such directory"),
    (["--model=config:nope"], "--model=config:nope: no configs/nope.py"),
    (["--repeats=0"], "--repeats=0: must be >= 1"),
    (["--attention=dense,flash"], "--attention=dense,flash: unknown value 'flash'"),
    (["--kv_dtype=int4"], "--kv_dtype=int4: unknown value 'int4'"),
])
def test_bench_bad_flag(tmp_path, no_jax, flags, expected):
  line = _run("infer.bench", [f"--model={MODEL}", *flags], f"{no_jax}{os.pathsep}{ROOT}")
  assert line.startswith("mtp-bench: error: ") and expected in line, line


def test_bench_empty_prompt_file(tmp_path, no_jax):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  line = _run("infer.bench", [f"--model={MODEL}", f"--prompts={empty}"],
              f"{no_jax}{os.pathsep}{ROOT}")
  assert f"--prompts={empty}: the file holds no requests" in line


@pytest.mark.parametrize("flags, expected", [
    (["--widen=-1"], "--widen=-1: must be >= 0"),
    (["--repeats=0"], "--repeats=0: must be >= 1"),
])
def test_demo_bad_flag(tmp_path, no_jax, flags, expected):
  line = _run("infer.demo", [f"--model={MODEL}", f"--out={tmp_path / 'out'}", *flags],
              f"{no_jax}{os.pathsep}{ROOT}")
  assert line.startswith("mtp-demo: error: ") and expected in line, line
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, expected", [
    (["--config.train.stepz=5"], "--config.train.stepz=5: the config has no field 'stepz' "
                                 "(did you mean 'steps'?)"),
    (["--config.train.steps=abc"], "--config.train.steps=abc: invalid literal"),
    (["--config.train.steps=-3"], "train.steps=-3: must be an integer >= 1"),
    (["--config=configs/nope.py"], "--config=configs/nope.py: cannot be loaded"),
    (["--mode=both"], "--mode=both: value should be one of"),
    (["--config.train.init_from=/no/such/model"],
     "--config.train.init_from=/no/such/model: no such directory"),
])
def test_train_bad_flag(tmp_path, flags, expected):
  wd = tmp_path / "run"
  line = _run("train.main", ["--config=configs/tiny.py", f"--workdir={wd}", *flags], ROOT)
  assert line.startswith("mtp-train: error: ") and expected in line, line
  assert not os.path.exists(wd) or not os.listdir(wd)


def test_train_unwritable_workdir(tmp_path):
  afile = tmp_path / "afile"
  afile.write_text("")
  line = _run("train.main", ["--config=configs/tiny.py", f"--workdir={afile}/run"], ROOT)
  assert line == f"mtp-train: error: --workdir={afile}/run: {afile} is not a directory"


def test_progress_plain_lines_off_a_terminal_and_nothing_when_quiet():
  import io

  from infer.progress import Progress
  out = io.StringIO()
  bar = Progress(4, "rows", desc="mtp-infer", every_s=3600, stream=out)
  for i in range(1, 5):
    bar.update(i, tokens_per_s=812.5, acceptance_length=2.31)
  bar.close()
  lines = out.getvalue().splitlines()           # only the last: every_s is an hour
  assert len(lines) == 1 and lines[0].startswith("mtp-infer: 4/4 rows, ")
  assert "ETA 0s" in lines[0] and "tokens/s 812, acceptance length 2.31" in lines[0]
  quiet = io.StringIO()
  bar = Progress(4, "rows", quiet=True, stream=quiet)
  bar.update(4)
  bar.write("log line")
  assert quiet.getvalue() == ""
