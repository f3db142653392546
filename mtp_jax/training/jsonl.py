"""A JSONL corpus (data.format='jsonl'): one record a line, `{"text": str}` or `{"messages":
[...]}` (OpenAI chat messages: role system / user / assistant, content a string or a list of text
parts); other keys are kept for the split's hash and otherwise ignored; blank lines are skipped.

Every record is a document, in file order: a text record's tokens, or its conversation rendered
with the tokenizer's chat template (add_generation_prompt=False), followed by the end-of-document
token, as a text file is. Records go to train / held-out by a hash of their canonical JSON (sorted
keys) with the files' rule (`data.is_heldout`), so a record's split depends on its content alone.

heads_only self-distillation on the trunk's own text (distill_source='generated') prompts the
trunk with rows of `prompt_rows`: each conversation up to its last user message, rendered with
the generation prompt; a text record's windows as for files.

A bad line (not UTF-8 or JSON, neither text nor messages, a malformed message, a template that
cannot render it) raises CorpusError naming the file, the line and the problem.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

import numpy as np

from mtp_jax.formats import chat
from mtp_jax.training import data as data_lib

_RECORD_KINDS = '{"text": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}'


class CorpusError(ValueError):
  """A JSONL corpus that cannot be read; the message names the file, the line and the problem."""


@dataclasses.dataclass
class Record:
  line: int                          # 1-based line number in the file
  key: str                           # canonical JSON of the record: what the split hashes
  text: str | None = None
  messages: list | None = None       # as in the file (checked by chat.check_messages)


def file_sha1(path: str) -> str:
  """The file's content hash (memoized on its size and modification time)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data.path={path!r}: not a file")
  st = os.stat(path)
  return _sha1(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha1(path: str, size: int, mtime_ns: int) -> str:
  del size, mtime_ns               # the cache key only
  h = hashlib.sha1()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def parse_line(path: str, n: int, raw: bytes) -> Record:
  """Line n (1-based) of the file -> a Record, or CorpusError naming file, line and problem."""
  def bad(why: str):
    return CorpusError(f"{path}:{n}: {why}")

  try:
    line = raw.decode("utf-8-sig")
  except UnicodeDecodeError as e:
    raise bad(f"not UTF-8 ({e.reason} at byte {e.start})") from None
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(obj, dict):
    raise bad(f"a record must be a JSON object {_RECORD_KINDS}, got {type(obj).__name__}")
  if "text" in obj and "messages" in obj:
    raise bad("a record holds \"text\" or \"messages\", not both")
  if "text" not in obj and "messages" not in obj:
    raise bad(f"a record needs \"text\" or \"messages\" ({_RECORD_KINDS}); it has keys "
              f"{sorted(obj)[:6]}")
  key = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
  if "text" in obj:
    if not isinstance(obj["text"], str):
      raise bad(f"\"text\" must be a string (got {type(obj['text']).__name__})")
    return Record(n, key, text=obj["text"])
  try:
    chat.check_messages(obj["messages"])
  except chat.ChatError as e:
    raise bad(str(e)) from None
  return Record(n, key, messages=obj["messages"])


def read_records(path: str) -> list[Record]:
  """Every record of the file, in order; CorpusError at the first bad line."""
  file_sha1(path)                  # a missing file: named as data.path
  with open(path, "rb") as f:
    records = [parse_line(path, n, raw) for n, raw in enumerate(f, 1) if raw.strip()]
  if not records:
    raise CorpusError(f"{path}: no records (one JSON object a line: {_RECORD_KINDS})")
  return records


def split_records(records: list[Record], heldout_permille: int) -> tuple[list, list]:
  heldout = [r for r in records if data_lib.is_heldout(r.key, heldout_permille)]
  train = [r for r in records if not data_lib.is_heldout(r.key, heldout_permille)]
  if not train:
    raise ValueError(f"data.heldout_permille={heldout_permille}: no training records left")
  return train, heldout


def check_no_messages(path: str, records: list[Record]):
  """For a tokenizer trained on the corpus, which has no chat template to render messages with:
  CorpusError at the first messages record."""
  chats = [r.line for r in records if r.messages is not None]
  if chats:
    raise _no_template(path, min(chats))


def iter_texts(records: list[Record], max_bytes: int | None = None):
  """The text records' texts (to train a tokenizer on)."""
  total = 0
  for r in records:
    if r.messages is None:
      yield r.text
      total += len(r.text)
      if max_bytes and total >= max_bytes:
        return


def _no_template(path: str, line: int) -> CorpusError:
  return CorpusError(f"{path}:{line}: a messages record needs a chat template and the "
                     "tokenizer has none (set data.tokenizer or train.init_from to a model "
                     f"directory with {chat.TEMPLATE_FILE})")


def encode_chat(path: str, r: Record, tokenizer, messages, add_generation_prompt: bool):
  """A record's messages rendered with the tokenizer's chat template -> token ids."""
  if not tokenizer.chat_template:
    raise _no_template(path, r.line)
  try:
    return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
  except chat.ChatError as e:
    raise CorpusError(f"{path}:{r.line}: {e}") from None


def tokenize_records(path: str, records: list[Record], tokenizer, chunk: int = 256) -> np.ndarray:
  """One token stream: every record's tokens (text, or the whole conversation rendered) followed
  by the end-of-document token."""
  parts = []
  for i in range(0, len(records), chunk):
    part = records[i: i + chunk]
    texts = iter(tokenizer.encode_batch([r.text for r in part if r.messages is None]))
    for r in part:
      ids = next(texts) if r.messages is None else encode_chat(path, r, tokenizer, r.messages,
                                                                False)
      parts.append(np.asarray(ids + [tokenizer.eod_id], np.int32))
  if not parts:
    return np.zeros((0,), np.int32)
  return np.concatenate(parts)


def chat_prompt(path: str, r: Record) -> list:
  """The conversation up to and including its last user message."""
  last = max((i for i, m in enumerate(r.messages) if m.get("role") == "user"), default=None)
  if last is None:
    raise CorpusError(f"{path}:{r.line}: a messages record needs a user message to prompt the "
                      "trunk with (train.distill_source='generated')")
  return r.messages[: last + 1]


def prompt_rows(path: str, records: list[Record], tokenizer, prompt_len: int,
                window: int) -> np.ndarray:
  """Distillation prompts -> [N, P + 1] int32: P = prompt_len tokens, then the prompt's length.

  A text record keeps the files' behaviour: the text records' stream cut into windows as the
  BatchIterator cuts it (stride window - 1), each window's first P tokens. A messages record
  gives one row: its chat_prompt rendered with the generation prompt, its last P tokens (a longer
  prompt loses its beginning), right-padded with end-of-document tokens."""
  eod, rows = tokenizer.eod_id, []
  stream = tokenize_records(path, [r for r in records if r.messages is None], tokenizer)
  n = max(0, (len(stream) - 1) // (window - 1))
  if n:
    idx = (np.arange(n) * (window - 1))[:, None] + np.arange(prompt_len)[None, :]
    rows.append(np.concatenate([stream[idx], np.full((n, 1), prompt_len, np.int32)], 1))
  for r in records:
    if r.messages is None:
      continue
    ids = encode_chat(path, r, tokenizer, chat_prompt(path, r), True)[-prompt_len:]
    if not ids:
      raise CorpusError(f"{path}:{r.line}: the chat template renders this prompt to no tokens")
    row = ids + [eod] * (prompt_len - len(ids)) + [len(ids)]
    rows.append(np.asarray([row], np.int32))
  if not rows:
    raise ValueError(f"data.path={path!r}: no distillation prompts (no messages record, and the "
                     f"text records hold fewer than one window of {window} tokens)")
  return np.concatenate(rows)
