"""The batch job: error records for bad lines, stop strings, resume exactly once."""

import json
import os

import pytest

from mtp_jax import api, batch
from mtp_jax import checkpoint as ckpt_lib
from mtp_jax.config import DecodeConfig


@pytest.fixture(scope="module")
def decoder(trained_tiny):
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  return api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=2, ring_size=8))


LINES = [
    b'{"id": "a", "prompt": "def f(x):\\n", "max_new_tokens": 6}',
    b'not json',
    b'{"id": "b", "prompt": ""}',
    b'{"id": "c", "prompt": "x", "temperature": -1}',
    b'{"id": "a", "prompt": "dup"}',
    b'{"id": "d", "prompt": "import os\\n", "top_p": 0}',
    b'\xff\xfe{"id": "e"}',
    b'{"id": "f", "prompt": "x = 1\\n", "max_new_tokens": "7"}',
    b'{"id": "g", "prompt": "' + b"x" * 5000 + b'"}',
    b'{"id": "h", "prompt": "class A:\\n", "max_new_tokens": 9, "temperature": 0.7, "top_k": 5}',
    b'{"prompt": "no id"}',
]


def test_bad_lines_become_error_records_and_good_lines_complete(decoder, tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_bytes(b"\n".join(LINES) + b"\n")
  summary = batch.run_job(decoder, str(inp), str(out), batch.Defaults(max_new_tokens=5))
  recs = {json.dumps(r["id"]): r for r in map(json.loads, out.read_text().splitlines())}
  assert len(recs) == len(LINES)
  err = lambda i: recs[json.dumps(i)]["error"]
  assert "not valid JSON" in err(2)
  assert err("b") == "prompt: empty"
  assert "temperature=-1" in err("c")
  assert "duplicate id 'a'" in err("line 5")
  assert "top_p=0" in err("d")
  assert "not valid UTF-8" in err(7)
  assert "max_new_tokens='7'" in err("f")
  assert "longer than" in err("g")
  for rid in ("a", "h", 11):
    r = recs[json.dumps(rid)]
    assert r["error"] is None and r["finish_reason"] in ("stop", "length")
    assert r["usage"]["completion_tokens"] <= (9 if rid == "h" else 6)
    assert r["spec"]["steps"] >= 0
  assert summary["completed"] == 3 and summary["errors"] == len(LINES) - 3
  assert json.load(open(str(out) + ".summary.json"))["completed"] == 3


def test_rerun_after_a_cut_line_serves_each_id_exactly_once(decoder, tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_text("".join(json.dumps({"id": i, "prompt": f"def f{i}(x):\n"}) + "\n"
                         for i in range(5)))
  defaults = batch.Defaults(max_new_tokens=4)
  batch.run_job(decoder, str(inp), str(out), defaults)
  lines = out.read_text().splitlines()
  # Keep two complete records and half of a third, as a kill during a write would leave.
  out.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:17])
  summary = batch.run_job(decoder, str(inp), str(out), defaults)
  ids = [json.loads(l)["id"] for l in out.read_text().splitlines()]
  assert sorted(ids) == list(range(5)) and summary["skipped_done"] == 2


def test_stop_strings_cut_the_text():
  c = api.Completion("abc\n\ndef", [1, 2, 3], "length", 3, 2, 1.5)
  item = batch.Item(1, "x", stop=("\n\n",))
  r = batch.record(item, c)
  assert r["text"] == "abc" and r["finish_reason"] == "stop"
