"""The batch job: both input forms, error records for bad lines, stop strings, per-row seeds,
greedy output equal to plain decoding, resume exactly once (also after SIGKILL)."""

import json
import os

import pytest

from mtp_jax.config import DecodeConfig
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.serving import api, batch
from tests.helpers import ROOT, infer, killed_and_resumed


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
    b'{"custom_id": "o1", "method": "POST", "url": "/v1/completions", '
    b'"body": {"model": "m", "prompt": "def g(y):\\n", "max_tokens": 5, "temperature": 0}}',
    b'{"custom_id": "o2", "method": "POST", "url": "/v1/chat/completions", "body": {}}',
    b'{"custom_id": "o3", "method": "POST", "url": "/v1/completions", '
    b'"body": {"prompt": "x", "max_tokens": 0}}',
    b'{"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}',
    b'{"custom_id": "o5", "url": "/v1/completions", "body": {"prompt": "x", "best": 2}}',
]


def test_bad_lines_become_error_records_and_good_lines_complete(decoder, tmp_path):
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  inp.write_bytes(b"\n".join(LINES) + b"\n")
  summary = batch.run_job(decoder, str(inp), str(out), batch.Defaults(max_new_tokens=5))
  lines = [json.loads(l) for l in out.read_text().splitlines()]
  assert len(lines) == len(LINES)
  recs = {json.dumps(r["id"]): r for r in lines if "custom_id" not in r}
  oai = {r["custom_id"]: r for r in lines if "custom_id" in r}
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
  good = oai["o1"]
  assert good["error"] is None and good["response"]["status_code"] == 200
  body = good["response"]["body"]
  assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] in (
      "stop", "length")
  assert 1 <= body["usage"]["completion_tokens"] <= 5
  assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                           + body["usage"]["completion_tokens"])
  oerr = lambda i: oai[i]["error"]["message"]
  assert oai["o2"]["response"]["status_code"] == 400 and "no chat template" in oerr("o2")
  assert "body.max_tokens=0" in oerr("o3")
  assert "custom_id: missing" in oerr("line 15")
  assert "body.best: unknown field" in oerr("o5")
  assert summary["completed"] == 4 and summary["errors"] == len(LINES) - 4
  assert json.load(open(str(out) + ".summary.json"))["completed"] == 4


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


def _prompts(n):
  heads = ["def f(x):\n", "import os\n", "class A:\n", "for i in range(", "x = [", "if a:\n"]
  return [heads[i % len(heads)] + "#" * (i // len(heads)) for i in range(n)]


def test_job_greedy_output_equals_plain_decoding_in_both_forms(decoder, tmp_path):
  prompts = _prompts(6)
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  lines = []
  for i, p in enumerate(prompts):
    if i % 2:
      lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": p, "max_tokens": 12}})
    else:
      lines.append({"id": i, "prompt": p, "max_new_tokens": 12})
  inp.write_text("".join(json.dumps(l) + "\n" for l in lines))
  batch.run_job(decoder, str(inp), str(out), batch.Defaults())
  got = {}
  for r in map(json.loads, out.read_text().splitlines()):
    if "custom_id" in r:
      got[int(r["custom_id"][1:])] = r["response"]["body"]["choices"][0]["text"]
    else:
      got[r["id"]] = r["text"]
  plain = api.Decoder(decoder.engine.model_cfg, decoder.engine.heads_cfg, decoder.params,
                      decoder.tokenizer, DecodeConfig(batch_size=3, k=0, ring_size=8))
  want = plain.generate(prompts, max_new_tokens=12)
  assert [got[i] for i in range(6)] == [c.text for c in want]
  # A second run on a fresh output writes the same records in the same order.
  out2 = tmp_path / "out2.jsonl"
  batch.run_job(decoder, str(inp), str(out2), batch.Defaults())
  strip = lambda t: [{k: v for k, v in json.loads(l).items() if k != "response"} | (
      {"text": json.loads(l)["response"]["body"]["choices"][0]["text"]}
      if "response" in json.loads(l) else {}) for l in t.splitlines()]
  assert strip(out.read_text()) == strip(out2.read_text())


def test_stop_strings_end_rows_early(decoder):
  prompt = "def f(x):\n"
  full = decoder.generate([prompt], max_new_tokens=60)[0]
  assert len(full.token_ids) >= 30, full
  # A stop string that first occurs after a few tokens: the text ends right before it and the
  # row stops decoding soon after (the host checks at chunk boundaries).
  tok = decoder.tokenizer
  early = tok.decode(full.token_ids[:6])
  stop = full.text[len(early): len(early) + 3]
  assert stop
  cut = decoder.generate([prompt], max_new_tokens=60, stop=[stop, "\x00never"])[0]
  assert cut.text == full.text[: full.text.find(stop)]
  assert cut.finish_reason == "stop"
  assert len(cut.token_ids) < len(full.token_ids)
  assert cut.steps < full.steps


def test_a_stopped_row_does_not_stop_the_request_that_takes_its_slot(trained_tiny):
  """One slot: the first request ends on a stop string (the host cancels its row), and the next
  request, refilled into the same slot in the same pass, decodes all its tokens."""
  _, workdir, _ = trained_tiny
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(os.path.join(workdir, "model"))
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=1, k=0, ring_size=8))
  prompt = tok.encode("def f(x):\n")
  full = dec.run([api.Request(prompt, 30)])[0]
  assert len(full.token_ids) >= 10, full
  stop = tok.decode(full.token_ids)[3:6]
  assert stop
  a, b = dec.run([api.Request(prompt, 30, stop=(stop,)), api.Request(prompt, 30)])
  assert a.finish_reason == "stop"
  assert b.token_ids == full.token_ids, (b.finish_reason, b.token_ids)


def test_per_row_seeds_make_sampled_rows_reproducible(decoder):
  enc = decoder.tokenizer.encode
  req = lambda p, s: api.Request(enc(p), 16, temperature=1.0, seed=s)
  a = decoder.run([req("def f(x):\n", 7), req("class A:\n", 3), req("def f(x):\n", 7),
                   req("def f(x):\n", 8)])
  # The same prompt and seed give the same tokens in another slot, batch and run.
  b = decoder.run([req("import os\n", 9), req("def f(x):\n", 7)])
  assert a[0].token_ids == a[2].token_ids == b[1].token_ids
  assert a[0].token_ids != a[3].token_ids      # another seed, another sample




def test_cli_missing_model_or_input_is_one_clear_line(tmp_path):
  inp = tmp_path / "in.jsonl"
  inp.write_text('{"prompt": "x"}\n')
  for args, msg in [([f"--model={tmp_path}/nope", f"--input={inp}"], "nope"),
                    ([f"--model={ROOT}/pretrained/demo", f"--input={tmp_path}/missing.jsonl"],
                     "missing.jsonl: no such file")]:
    p = infer(args + [f"--output={tmp_path}/o.jsonl"])
    _, err = p.communicate(timeout=300)
    assert p.returncode != 0 and msg in err.strip().splitlines()[-1], err


def test_job_killed_with_sigkill_resumes_exactly_once(trained_tiny, tmp_path):
  _, workdir, _ = trained_tiny
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  n = 160     # rows enough that the job cannot end between two polls once its programs are cached
  inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "max_new_tokens": 24}) + "\n"
                         for i, p in enumerate(_prompts(n))))
  args = [f"--model={workdir}/model", f"--input={inp}", f"--output={out}", "--k=2",
          "--batch_size=2", "--quiet"]
  recs = killed_and_resumed(args, out, n)
  assert sorted(r["id"] for r in recs) == sorted(f"r{i}" for i in range(n))
  assert all(r["error"] is None for r in recs)
  summary = json.load(open(str(out) + ".summary.json"))
  assert summary["skipped_done"] >= 5 and summary["completed"] == n - summary["skipped_done"]
