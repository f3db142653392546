"""mtp-bench's mode grammar (mtp_jax/bench/modes.py)."""

import re
import subprocess
import sys

import pytest

from mtp_jax.bench.modes import parse_mode


@pytest.mark.parametrize("mode, parsed", [
    ("vanilla", ("heads", 0)), ("control", ("heads", 0)), ("adaptive", ("heads", "auto")),
    ("mtp:3", ("heads", 3)), ("mtp:03", ("heads", 3)), ("draft:2", ("model", 2)),
    ("ngram:1", ("ngram", 1)), ("tree:8", ("heads", "tree:8")), ("tree:016", ("heads", "tree:16"))])
def test_modes_parse(mode, parsed):
  assert parse_mode(mode) == parsed


@pytest.mark.parametrize("mode", ["fast:3", "mtp:0", "mtp:", "mtp", "tree:0", "vanilla:1",
                                  "mtp:-1", "mtp:1.5", "mtp:\u0663", "MTP:3", ""])
def test_bad_modes_are_named(mode):
  with pytest.raises(ValueError, match=re.escape(f"unknown mode {mode!r}")):
    parse_mode(mode)


def test_the_grammar_imports_no_jax():
  """mtp-bench checks its flags with it before JAX is imported."""
  code = "import sys, infer.bench; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"
