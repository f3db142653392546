"""Flag checks of the command-line tools, run before JAX is imported or a model is loaded: a bad
value is the user's mistake, reported at once in one line that names the flag and the value.

Each check raises FlagError("--name=value: what is wrong"); the tools print it and exit 1.
"""

import json
import os
import re
import sys

from absl import flags


class FlagError(ValueError):
  pass


def _fail(name: str, value, why: str):
  raise FlagError(f"--{name}={value}: {why}")


def number(name: str, value, lo=None, hi=None, lo_open: bool = False):
  """lo <= value <= hi (lo < value with lo_open)."""
  low_ok = lo is None or value > lo or (value == lo and not lo_open)
  if not low_ok or (hi is not None and value > hi):
    want = [f"{'>' if lo_open else '>='} {lo}"] if lo is not None else []
    want += [f"<= {hi}"] if hi is not None else []
    _fail(name, value, "must be " + " and ".join(want))


def int_or_auto(name: str, value: str, lo: int):
  if value == "auto":
    return
  try:
    n = int(value)
  except ValueError:
    _fail(name, value, f"must be 'auto' or an integer >= {lo}")
  if n < lo:
    _fail(name, value, f"must be 'auto' or an integer >= {lo}")


def k_spec(name: str, value: str, lo: int):
  """--k: 'auto', an integer >= lo, or tree:T (a token tree of T >= 1 nodes)."""
  if re.fullmatch(r"tree:0*[1-9][0-9]*", value):
    return
  try:
    int_or_auto(name, value, lo)
  except FlagError:
    _fail(name, value, f"must be 'auto' or an integer >= {lo} (or tree:T: a token tree of "
          "T >= 1 nodes)")


def int_list(name: str, values: list[str], lo: int) -> list[int]:
  if not values:
    _fail(name, "", "must list at least one value")
  try:
    out = [int(v) for v in values]
  except ValueError:
    _fail(name, ",".join(values), "must be a comma-separated list of integers")
  if min(out) < lo:
    _fail(name, ",".join(values), f"every value must be >= {lo}")
  return out


def model_dir(name: str, path: str):
  """A model directory (config.json inside); config:NAME specs are checked by their loader."""
  if not os.path.isdir(path):
    _fail(name, path, "no such directory")
  if not os.path.isfile(os.path.join(path, "config.json")):
    _fail(name, path, "not a model directory (no config.json)")


def model_spec(name: str, spec: str):
  """A model directory, 'config:NAME' (configs/NAME.py, random weights) or 'widen:N:DIR'."""
  if spec.startswith("config:"):
    config = spec[len("config:"):]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(here, "configs", config + ".py")):
      _fail(name, spec, f"no configs/{config}.py")
  elif spec.startswith("widen:"):        # widen:N:DIR (mtp_jax/bench/widen.py)
    model_dir(name, spec.split(":", 2)[-1])
  else:
    model_dir(name, spec)


def input_file(name: str, path: str):
  """A readable file with at least one non-blank line."""
  if not os.path.isfile(path):
    _fail(name, path, "no such file")
  try:
    with open(path, "rb") as f:
      if not any(line.strip() for line in f):
        _fail(name, path, "the file holds no requests (it is empty)")
  except OSError as e:
    _fail(name, path, f"cannot be read ({e.strerror})")


def _writable_dir(name: str, value: str, d: str):
  if not os.path.isdir(d):
    _fail(name, value, f"directory {d} does not exist")
  if not os.access(d, os.W_OK | os.X_OK):
    _fail(name, value, f"directory {d} is not writable")


def output_file(name: str, path: str):
  """A file that can be created or appended to (its directory exists and is writable)."""
  if os.path.isdir(path):
    _fail(name, path, "is a directory; give a file path")
  if os.path.exists(path) and not os.access(path, os.W_OK):
    _fail(name, path, "is not writable")
  _writable_dir(name, path, os.path.dirname(os.path.abspath(path)))


def output_dir(name: str, path: str):
  """A directory that exists and is writable, or can be created (its nearest existing parent
  is a writable directory)."""
  p = os.path.abspath(path)
  if os.path.exists(p) and not os.path.isdir(p):
    _fail(name, path, "exists and is not a directory")
  while not os.path.exists(p):
    p = os.path.dirname(p)
  if not os.path.isdir(p):
    _fail(name, path, f"{p} is not a directory")
  if not os.access(p, os.W_OK | os.X_OK):
    _fail(name, path, f"directory {p} is not writable")


def prompts_spec(name: str, path: str):
  """mtp-bench's --prompts: '' (held-out code), a directory, or a JSONL file with a prompt on
  at least one line."""
  if not path or os.path.isdir(path):
    return
  input_file(name, path)
  with open(path, "rb") as f:
    for raw in f:
      if raw.strip():
        try:
          json.loads(raw)
        except ValueError:
          _fail(name, path, "not JSONL (a line is not valid JSON)")
        return


def flags_parser(tool: str):
  """An absl flags_parser for app.run: a flag that does not parse (a bad type, a missing required
  flag, a --config.* override of a field the config lacks) is one line on stderr, exit 1."""
  def fail(msg: str):
    sys.stderr.write(f"{tool}: error: {msg}\n")
    sys.exit(1)

  def parse(argv):
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      msg = str(e).removeprefix("flag ")
      missing = re.match(r"--(\w+)=None: Flag --\w+ must have a value other than None", msg)
      fail(f"--{missing.group(1)}: required, and not given" if missing else msg)
    except (AttributeError, KeyError) as e:
      # ml_collections raises these, with a traceback, for an override of an unknown field.
      field = re.search(r'instead of "(\w+)"', str(e)) or re.search(r"(\w+)", str(e))
      name = field.group(1) if field else "?"
      bad = [a for a in argv[1:] if re.match(rf"--config\.[\w.]*\b{re.escape(name)}(=|\.|$)", a)]
      hint = re.search(r'Did you mean "([^"]+)"', str(e))
      fail(f"{bad[0] if bad else '--config.*' + name}: the config has no field {name!r}"
           + (f" (did you mean {hint.group(1)!r}?)" if hint else ""))
  return parse
