"""A JSONL corpus: text and messages records, chat rendering, the content-hash split, errors that
name file and line, and training on it (joint resumes bit-identically; heads_only on chat
prompts)."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from mtp_jax.formats import chat
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.formats import tokenizer as T
from mtp_jax.training import data as D
from mtp_jax.training import jsonl as J
from mtp_jax.training import trainer as train_lib
from tests.conftest import tiny_config

TEMPLATE = ("{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
            "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
CHAT_TOKENS = {"bos_token": "<s>"}
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": [{"type": "text", "text": "4"},
                                                  {"type": "text", "text": "(four)"}]},
                {"role": "user", "content": "And 3 + 3?"},
                {"role": "assistant", "content": "6"}]


def _bpe():
  texts = ["[system] [user] [assistant] What is the answer? Be brief. def f(x): return x\n"] * 20
  return T.train_bpe(texts, 300)


@pytest.fixture(scope="module")
def chat_tokenizer():
  return T.Tokenizer(_bpe().hf, chat_template=TEMPLATE, chat_tokens=CHAT_TOKENS)


def _write(path, lines):
  with open(path, "wb") as f:
    for line in lines:
      f.write((line if isinstance(line, bytes) else
               (line if isinstance(line, str) else json.dumps(line)).encode()) + b"\n")
  return str(path)


def _corpus_records(n_chars=600):
  """The tiny config's corpus (stdlib json/*.py) cut into text records of about n_chars."""
  cfg = tiny_config().data
  text = "".join(D.iter_texts(cfg, D.list_files(cfg)))
  return [text[i: i + n_chars] for i in range(0, len(text), n_chars)]


def test_records_render_with_the_chat_template_and_prompt_up_to_the_last_user(chat_tokenizer,
                                                                              tmp_path):
  tok = chat_tokenizer
  path = _write(tmp_path / "c.jsonl", [{"text": "def f(x): return x"}, "",
                                       {"messages": CONVERSATION, "id": 7}])
  records = J.read_records(path)
  assert [r.line for r in records] == [1, 3]          # blank lines skipped, still counted
  whole = ("<s>[system] Be brief.\n[user] What is 2 + 2?\n[assistant] 4\n(four)\n"
           "[user] And 3 + 3?\n[assistant] 6\n")
  assert chat.render(TEMPLATE, CONVERSATION, CHAT_TOKENS, False) == whole
  enc = lambda s: tok.hf.encode(s, add_special_tokens=False).ids
  stream = J.tokenize_records(path, records, tok)
  expected = tok.encode("def f(x): return x") + [tok.eod_id] + enc(whole) + [tok.eod_id]
  assert stream.tolist() == expected
  # The distillation prompt: up to the last user message, with the generation prompt.
  prompt = enc("<s>[system] Be brief.\n[user] What is 2 + 2?\n[assistant] 4\n(four)\n"
               "[user] And 3 + 3?\n[assistant] ")
  rows = J.prompt_rows(path, records[1:], tok, prompt_len=len(prompt) + 5, window=200)
  assert rows.shape == (1, len(prompt) + 6) and rows[0, -1] == len(prompt)
  assert rows[0, :len(prompt)].tolist() == prompt
  assert rows[0, len(prompt): -1].tolist() == [tok.eod_id] * 5
  # A prompt longer than distill_prompt_len keeps its end.
  short = J.prompt_rows(path, records[1:], tok, prompt_len=8, window=200)
  assert short[0].tolist() == prompt[-8:] + [8]


def test_text_records_give_the_files_prompts(chat_tokenizer, tmp_path):
  tok = chat_tokenizer
  texts = ["What is the answer? " * 20, "Be brief. " * 30]
  path = _write(tmp_path / "t.jsonl", [{"text": t} for t in texts])
  records = J.read_records(path)
  stream = J.tokenize_records(path, records, tok)
  rows = J.prompt_rows(path, records, tok, prompt_len=6, window=21)
  it = D.BatchIterator(stream, batch_size=1, window=21, seed=0)
  assert len(rows) == it.num_windows
  for i in range(len(rows)):
    assert rows[i, :6].tolist() == stream[i * 20: i * 20 + 6].tolist() and rows[i, 6] == 6


def test_split_hashes_the_record_not_its_line(tmp_path):
  records = [{"text": f"document {i}"} for i in range(200)]
  records += [{"messages": [{"role": "user", "content": f"q{i}"}], "id": i} for i in range(200)]
  a = J.read_records(_write(tmp_path / "a.jsonl", records))
  # The same records shuffled, with their keys in another order.
  shuffled = [dict(reversed(list(r.items()))) for r in records[::-1]]
  b = J.read_records(_write(tmp_path / "b.jsonl", shuffled))
  tr_a, he_a = J.split_records(a, 200)
  tr_b, he_b = J.split_records(b, 200)
  assert sorted(r.key for r in he_a) == sorted(r.key for r in he_b)
  assert 40 < len(he_a) < 120 and len(tr_a) + len(he_a) == 400
  assert [r.key for r in J.split_records(a, 200)[1]] == [r.key for r in he_a]
  heldout_lines = {r.line for r in he_a}         # the rule: the canonical JSON's hash
  for i, r in enumerate(records):
    key = json.dumps(r, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert D.is_heldout(key, 200) == (i + 1 in heldout_lines)


@pytest.mark.parametrize("line, problem", [
    ("{not json", r"not valid JSON \(Expecting property name"),
    ("[1, 2]", "a record must be a JSON object .* got list"),
    ('{"prompt": "x"}', r"a record needs \"text\" or \"messages\" .* it has keys \['prompt'\]"),
    ('{"text": "a", "messages": []}', 'a record holds "text" or "messages", not both'),
    ('{"text": 3}', '"text" must be a string \\(got int\\)'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"messages\[0\].role='robot'"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     r"messages\[0\].content\[0\]: only text parts"),
    ('{"messages": []}', "messages: must be a non-empty list"),
    (b'{"text": "\xff"}', "not UTF-8"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, problem):
  path = _write(tmp_path / "bad.jsonl", [{"text": "fine"}, "", line, {"text": "never read"}])
  with pytest.raises(J.CorpusError, match=f"bad.jsonl:3: {problem}"):
    J.read_records(path)


def test_rendering_errors_name_file_and_line(chat_tokenizer, tmp_path):
  path = _write(tmp_path / "c.jsonl", [{"text": "x"}, {"messages": CONVERSATION}])
  records = J.read_records(path)
  plain = T.Tokenizer(chat_tokenizer.hf)
  with pytest.raises(J.CorpusError, match="c.jsonl:2: a messages record needs a chat template"):
    J.tokenize_records(path, records, plain)
  raising = T.Tokenizer(chat_tokenizer.hf, chat_template=(
      "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"))
  with pytest.raises(J.CorpusError, match="c.jsonl:2: chat template raised: no system role"):
    J.tokenize_records(path, records, raising)
  answer_only = _write(tmp_path / "a.jsonl", [{"messages": [{"role": "assistant",
                                                             "content": "hi"}]}])
  with pytest.raises(J.CorpusError, match="a.jsonl:1: a messages record needs a user message"):
    J.prompt_rows(answer_only, J.read_records(answer_only), chat_tokenizer, 8, 20)
  with pytest.raises(FileNotFoundError, match="data.path='/no/such.jsonl'"):
    J.read_records("/no/such.jsonl")
  with pytest.raises(J.CorpusError, match="e.jsonl: no records"):
    J.read_records(_write(tmp_path / "e.jsonl", ["", "  "]))


def test_a_bad_line_stops_training_before_it_starts(tmp_path):
  path = _write(tmp_path / "bad.jsonl", [{"text": t} for t in _corpus_records()[:20]]
                + ['{"text": "x"'])
  workdir = str(tmp_path / "run")
  with pytest.raises(J.CorpusError, match="bad.jsonl:21: not valid JSON"):
    train_lib.train(tiny_config(data={"format": "jsonl", "path": path}), workdir,
                    log=lambda s: None)
  assert not os.path.exists(os.path.join(workdir, "run_config.json"))
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))
  # A tokenizer trained on the corpus has no chat template: refused before it is trained.
  chats = _write(tmp_path / "chats.jsonl", [{"text": "x"}, {"messages": CONVERSATION}])
  with pytest.raises(J.CorpusError, match="chats.jsonl:2: a messages record needs a chat "
                     "template and the tokenizer has none"):
    train_lib.train(tiny_config(data={"format": "jsonl", "path": chats}), workdir,
                    log=lambda s: None)
  assert not os.path.exists(os.path.join(workdir, "tokenizer.json"))


def test_prompt_batches_are_a_function_of_their_state():
  rows = np.arange(50 * 5, dtype=np.int32).reshape(50, 5)
  it = D.PromptBatches(rows, batch_size=4, seed=1)
  first = [next(it) for _ in range(30)]                   # crosses epochs (50 rows / 4)
  assert first[0][0].shape == (4, 4) and first[0][1].shape == (4,)
  np.testing.assert_array_equal(first[0][1], first[0][0][:, 0] + 4)   # lengths: the last column
  again = D.PromptBatches(rows, batch_size=4, seed=1)
  again.restore(it.state() | {"next_batch": 17})
  np.testing.assert_array_equal(next(again)[0], first[17][0])
  epoch0 = np.concatenate([b[0] for b in first[:12]])[:, 0]
  assert len(set(epoch0.tolist())) == len(epoch0)


def test_distill_batch_of_short_prompts_starts_at_zero_and_ends_in_eod():
  """A chat prompt row of length l: its prompt, the trunk's W - P tokens from position l, then
  end-of-document tokens; a row of length P is exactly the text path's."""
  from mtp_jax.models import model as M
  cfg = tiny_config(train={"mode": "heads_only", "init_from": "unused"})
  graphdef, params = M.split(M.create(cfg.model, cfg.heads, seed=1))
  p, w = cfg.train.distill_prompt_len, cfg.data.seq_len + cfg.heads.num + 1
  tok = T.Tokenizer(_bpe().hf, eod_token=T.PAD)        # an end-of-document token that is not 0
  trainer = train_lib.Trainer(cfg, graphdef, tok, train_lib.make_optimizer(cfg))
  eod = tok.eod_id
  assert eod != 0
  prompt = np.random.default_rng(0).integers(2, 200, (2, p)).astype(np.int32)
  prompt[1, 5:] = eod
  out = np.asarray(trainer.distill_batch(params, prompt, np.array([p, 5])))
  assert out.shape == (2, w)
  np.testing.assert_array_equal(out[0], np.asarray(trainer.distill_batch(params, prompt))[0])
  assert out[1, :5].tolist() == prompt[1, :5].tolist()
  assert out[1, 5 + w - p:].tolist() == [eod] * (p - 5)


def _params(model_dir):
  return ckpt_lib.load_model_dir(model_dir)[2]


def _assert_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_jsonl_text_records_train_and_resume_bit_identically(tmp_path):
  path = _write(tmp_path / "corpus.jsonl", [{"text": t} for t in _corpus_records()])
  cfg = tiny_config(data={"format": "jsonl", "path": path},
                    train={"steps": 3, "checkpoint_every": 1, "eval_every": 3})
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  train_lib.train(cfg, straight, log=lambda s: None)
  train_lib.train(cfg, resumed, log=lambda s: None, stop_after=2)
  lines = []
  train_lib.train(cfg, resumed, log=lines.append)
  assert any("resumed from step 2" in line for line in lines)
  _assert_equal(_params(os.path.join(straight, "model")), _params(os.path.join(resumed, "model")))
  names = sorted(f for f in os.listdir(resumed) if f.startswith("tokens_"))
  assert [n.split("_")[1] for n in names] == ["heldout", "train"]
  run_config = json.load(open(os.path.join(resumed, "run_config.json")))
  assert run_config["data"]["format"] == "jsonl" and run_config["data.sha1"] == J.file_sha1(path)
  # A changed file is never resumed with (nor its token cache reused).
  with open(path, "a") as f:
    f.write(json.dumps({"text": "one more record"}) + "\n")
  with pytest.raises(ValueError, match=r"differs in: \['data.sha1'\]"):
    train_lib.train(cfg, resumed, log=lambda s: None)


def _chat_model_dir(src, dst):
  """The tiny trained model with a chat template (and the special token it reads)."""
  shutil.copytree(src, dst)
  with open(os.path.join(dst, chat.TEMPLATE_FILE), "w") as f:
    f.write(TEMPLATE)
  meta = json.load(open(os.path.join(dst, "config.json")))
  meta.setdefault("tokenizer", {})["chat_tokens"] = CHAT_TOKENS
  json.dump(meta, open(os.path.join(dst, "config.json"), "w"))
  return dst


def test_heads_only_distils_from_chat_prompts_and_resumes(trained_tiny, tmp_path):
  _, workdir, _ = trained_tiny
  model = _chat_model_dir(os.path.join(workdir, "model"), str(tmp_path / "chat_model"))
  chunks = _corpus_records(200)
  # Long prompts (cut to distill_prompt_len) and short ones (right-padded).
  records = [{"messages": [{"role": "user", "content": chunks[i][: 200 if i % 4 else 8]},
                           {"role": "assistant", "content": chunks[i + 1]}]}
             for i in range(0, min(len(chunks) - 1, 120), 2)]
  records += [{"text": t} for t in chunks[:10]]
  path = _write(tmp_path / "chats.jsonl", records)
  cfg = tiny_config(data={"format": "jsonl", "path": path},
                    train={"mode": "heads_only", "init_from": model, "steps": 4,
                           "checkpoint_every": 2, "eval_every": 4, "distill_prompt_len": 24})
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  lines = []
  train_lib.train(cfg, straight, log=lines.append)
  assert any("self-distillation from" in line for line in lines), lines
  train_lib.train(cfg, resumed, log=lambda s: None, stop_after=2)
  train_lib.train(cfg, resumed, log=lambda s: None)
  before, a, b = (_params(d) for d in (model, os.path.join(straight, "model"),
                                       os.path.join(resumed, "model")))
  _assert_equal(a, b)
  _assert_equal(before["trunk"], a["trunk"])
  assert os.path.exists(os.path.join(straight, "model", chat.TEMPLATE_FILE))
  rows = np.load(next(os.path.join(straight, f) for f in os.listdir(straight)
                      if f.startswith("tokens_prompts_")))
  assert rows.shape[1] == 25 and rows[:, -1].min() < 24     # some prompts are short


def test_a_run_config_stored_before_the_data_format_existed_still_resumes(tmp_path):
  from mtp_jax.training import workdir as W
  cfg = tiny_config()
  W.check_run_config(str(tmp_path), cfg)
  path = tmp_path / "run_config.json"
  stored = json.loads(path.read_text())
  del stored["data"]["format"], stored["data"]["path"]
  path.write_text(json.dumps(stored))
  W.check_run_config(str(tmp_path), cfg)                    # the new fields at their defaults
  with pytest.raises(ValueError, match=r"differs in: \['data'\]"):
    W.check_run_config(str(tmp_path), tiny_config(data={"seq_len": 32}))
  (tmp_path / "new").mkdir()
  W.check_run_config(str(tmp_path / "new"), cfg, write=False)
  assert not (tmp_path / "new" / "run_config.json").exists()
