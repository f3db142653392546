"""The batch job's file formats: JSONL requests in, one JSONL record per input line out.

Two input forms, detected per line:
  plain   {"id": ..., "prompt": "...", "max_new_tokens": N, "temperature": T, "top_p": P,
          "top_k": K, "repetition_penalty": R, "stop": ["..."], "seed": S}
          (all but id and prompt optional; a missing id is the line number); "messages" (a chat
          conversation, rendered with the model's chat template) may stand for "prompt"
  openai  the request lines of the OpenAI batch API for /v1/completions and
          /v1/chat/completions (openai.py)
Output records follow the line's form: plain lines get {"id", "text", "finish_reason", "usage",
"spec", "error"}; OpenAI lines get {"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"} with a text_completion or chat.completion body. A line that cannot be served
becomes an error record naming the problem (field, value or line; a chat line for a model with no
template, or whose template raises, says so); it never stops the job. Records are appended and
flushed as rows finish; a rerun skips ids already in the output, so an interrupted job resumes and
every id ends up exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from mtp_jax.formats.chat import ChatError
from mtp_jax.serving import openai
from mtp_jax.serving.api import Completion, Request


@dataclasses.dataclass
class Defaults:
  max_new_tokens: int = 128
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  repetition_penalty: float = 1.0
  seed: int = 0               # the job's seed; a line without "seed" gets one from it and its line


@dataclasses.dataclass
class Item:
  line: int
  id: object
  request: Request | None = None
  error: str | None = None
  form: str = "plain"         # 'plain' or 'openai' (then id is the custom_id)
  chat: bool = False          # a conversation (messages), rendered with the chat template

  @property
  def key(self) -> str:
    return json.dumps([self.form, self.id])


_NUMBERS = {"max_new_tokens": int, "top_k": int, "temperature": float, "top_p": float,
            "repetition_penalty": float, "seed": int}
def _check(name, value, max_new_cap):
  if name == "max_new_tokens" and not 1 <= value <= max_new_cap:
    return f"max_new_tokens={value}: must be in 1..{max_new_cap}"
  if name == "temperature" and value < 0:
    return f"temperature={value}: must be >= 0"
  if name == "top_p" and not 0 < value <= 1:
    return f"top_p={value}: must be in (0, 1]"
  if name == "top_k" and value < 0:
    return f"top_k={value}: must be >= 0"
  if name == "repetition_penalty" and value <= 0:
    return f"repetition_penalty={value}: must be > 0"
  if name == "seed" and not 0 <= value < 2**31:
    return f"seed={value}: must be in 0..2**31-1"
  return None


def parse_line(raw: bytes, line_no: int, defaults: Defaults, tokenizer, max_prompt: int,
               max_new_cap: int) -> Item:
  """One input line -> an Item with a Request, or with an error naming the problem."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return Item(line_no, line_no,
                error=f"line {line_no}: not valid UTF-8 ({e.reason} at byte {e.start})")
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    return Item(line_no, line_no,
                error=f"line {line_no}: not valid JSON ({e.msg} at column {e.colno})")
  if not isinstance(obj, dict):
    return Item(line_no, line_no, error=f"line {line_no}: a request must be a JSON object")
  if "custom_id" in obj or "body" in obj:
    form, prefix, body = "openai", "body.", obj.get("body")
    rid, fields, chat = openai.fields(obj, line_no, set(_NUMBERS) | {"prompt", "messages", "stop"})
    if chat is None:
      return Item(line_no, rid, error=fields, form=form)
  else:
    form, fields, prefix, body = "plain", obj, "", {}
    chat = "messages" in obj and "prompt" not in obj
    rid = obj.get("id", line_no)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
      return Item(line_no, line_no, error=f"line {line_no}: id must be a string or an integer")
  err = lambda msg: Item(line_no, rid, error=prefix + msg, form=form, chat=chat)
  params, msg = _sampling(fields, form, body, defaults, line_no, max_new_cap)
  if msg:
    return err(msg)
  stop = fields.get("stop") or []
  if isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    return err("stop: must be a non-empty string or a list of them")
  if chat:
    try:
      ids = tokenizer.encode_chat(fields.get("messages"))
    except ChatError as e:
      return err(str(e))
  else:
    prompt = fields.get("prompt")
    if not isinstance(prompt, str):
      return err(f"prompt: missing or not a string (got {type(prompt).__name__})")
    if not prompt:
      return err("prompt: empty")
    ids = tokenizer.encode(prompt)
  if len(ids) > max_prompt:
    what = "messages" if chat else "prompt"
    return err(f"{what}: {len(ids)} tokens, longer than the {max_prompt} the context allows")
  return Item(line_no, rid, Request(ids, stop=tuple(stop), **params), form=form, chat=chat)


def _sampling(fields, form, body, defaults: Defaults, line_no: int, max_new_cap: int):
  """-> (the Request's sampling fields, None) or (None, the problem)."""
  params = dataclasses.asdict(defaults)
  params["seed"] = (defaults.seed * 1_000_003 + line_no) % 2**31
  shown = lambda name: openai.shown_name(name, body) if form == "openai" else name
  for name, typ in _NUMBERS.items():
    if name not in fields or (form == "openai" and fields[name] is None):
      continue
    v = fields[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
        typ is int and not isinstance(v, int)):
      return None, f"{shown(name)}={v!r}: must be {'an integer' if typ is int else 'a number'}"
    params[name] = typ(v)
  for name, v in params.items():
    msg = _check(name, v, max_new_cap)
    if msg:
      return None, msg.replace(name, shown(name), 1)
  return params, None


def load_done(path: str) -> set:
  """Keys (form, id) already written to the output. A last line cut by a kill is removed."""
  done = set()
  if not os.path.exists(path):
    return done
  with open(path, "rb") as f:
    data = f.read()
  keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
  if keep != data:
    with open(path, "wb") as f:
      f.write(keep)
  for line in keep.splitlines():
    try:
      rec = json.loads(line)
      key = (["openai", rec["custom_id"]] if "custom_id" in rec else ["plain", rec["id"]])
    except (json.JSONDecodeError, KeyError, TypeError):
      continue
    done.add(json.dumps(key))
  return done


def record(item: Item, c: Completion | None = None, model: str = "mtp-jax") -> dict:
  """The output record of one line, in the line's form (c is None for an error record)."""
  if item.form == "openai":
    return openai.record(item.line, item.id, item.chat, c, item.error,
                         None if c is None else _spec(c), model)
  if c is None:
    return {"id": item.id, "text": None, "finish_reason": "error",
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "spec": None,
            "error": item.error}
  return {"id": item.id, "text": c.text, "finish_reason": c.finish_reason,
          "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids)},
          "spec": _spec(c), "error": None}


def _spec(c: Completion) -> dict:
  return {"steps": c.steps, "acceptance_length": round(c.acceptance_length, 4)}


def read_items(decoder, input_path: str, done_keys: set, defaults: Defaults) -> list[Item]:
  """Parses the input file (skipping lines whose key is done); duplicates become errors."""
  eng = decoder.engine
  max_prompt = eng.cfg.max_len - eng.span - 2
  max_new_cap = eng.cfg.max_len
  items, seen = [], set()
  with open(input_path, "rb") as f:
    for no, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      item = parse_line(raw.rstrip(b"\r\n"), no, defaults, decoder.tokenizer, max_prompt,
                        max_new_cap)
      if item.key in done_keys:
        continue
      if item.key in seen:
        name = "custom_id" if item.form == "openai" else "id"
        item = Item(no, f"line {no}", error=f"line {no}: duplicate {name} {item.id!r}",
                    form=item.form)
        if item.key in done_keys:
          continue
      seen.add(item.key)
      items.append(item)
  return items


def needed_len(input_path: str, tokenizer, default_max_new: int) -> int:
  """The longest prompt + max_new_tokens among the input's lines (lines that do not parse are
  skipped here; they become error records later): the cache length the job needs."""
  need = 0
  with open(input_path, "rb") as f:
    for raw in f:
      try:
        obj = json.loads(raw)
        fields = obj.get("body", obj) if isinstance(obj, dict) else {}
        prompt = fields.get("prompt") if isinstance(fields, dict) else None
        if isinstance(prompt, list) and len(prompt) == 1:
          prompt = prompt[0]
        if isinstance(prompt, str):
          n = len(tokenizer.encode(prompt))
        elif isinstance(fields, dict) and "messages" in fields:
          n = len(tokenizer.encode_chat(fields["messages"]))
        else:
          continue
        m = fields.get("max_new_tokens", fields.get("max_tokens",
                                                    fields.get("max_completion_tokens")))
        m = m if isinstance(m, int) and not isinstance(m, bool) and m > 0 else default_max_new
        need = max(need, n + m)
      except (ValueError, UnicodeDecodeError, AttributeError):   # ChatError is a ValueError
        continue
  return need


def count_lines(input_path: str) -> int:
  with open(input_path, "rb") as f:
    return sum(1 for raw in f if raw.strip())


def run_job(decoder, input_path: str, output_path: str, defaults: Defaults, progress=None,
            model_name: str = "mtp-jax", t0: float | None = None) -> dict:
  """Serves every line of input_path not yet in output_path; returns the summary (also written
  beside the output as OUTPUT.summary.json). `progress(counts, total)` is called once before
  decoding and after every finished row: counts holds completed, tokens and decode_steps (row
  steps) so far, total the rows to decode. t0: when the job began (perf_counter; default now):
  the summary's first_token_s counts from it."""
  t0 = time.perf_counter() if t0 is None else t0
  first = []
  done_keys = load_done(output_path)
  items = read_items(decoder, input_path, done_keys, defaults)
  served = [it for it in items if it.request is not None]
  counts = {"skipped_done": len(done_keys), "errors": 0, "completed": 0, "tokens": 0,
            "decode_steps": 0}
  with open(output_path, "a") as out:
    def write(rec):
      out.write(json.dumps(rec) + "\n")
      out.flush()
    for it in items:
      if it.request is None:
        write(record(it, model=model_name))
        counts["errors"] += 1
    t_start = time.perf_counter()
    if progress:
      progress(counts, len(served))

    def on_done(i, c):
      first.append(t_start + c.ttft_s)
      write(record(served[i], c, model_name))
      counts["completed"] += 1
      counts["tokens"] += len(c.token_ids)
      counts["decode_steps"] += c.steps
      if progress:
        progress(counts, len(served))

    if served:
      decoder.run([it.request for it in served], on_done=on_done)
  wall = time.perf_counter() - t0
  decode_wall = time.perf_counter() - t_start
  stats = decoder.last_stats if served else {}
  summary = {**counts, "rows": len(items), "slots": decoder.engine.cfg.batch_size,
             "k": "auto" if decoder.engine.cfg.adaptive else
                  decoder.engine.tree.name if decoder.engine.tree else decoder.engine.kd,
             "wall_s": round(wall, 3), "decode_wall_s": round(decode_wall, 3),
             # From t0: the first token (prefill's), the first decode step's on the host.
             "first_token_s": round(min(first) - t0, 3) if first else None,
             "first_step_s": (round(t_start - t0 + decoder.last_timing["first_step_s"], 3)
                              if served and decoder.last_timing.get("first_step_s") else None),
             "tokens_per_s": round(counts["tokens"] / decode_wall, 2) if served else 0.0,
             # Tokens written past each row's first, per row step, as the progress line shows
             # it (Decoder.last_stats counts what the steps emitted, before EOD and stop strings
             # cut a row).
             "acceptance_length": (round((counts["tokens"] - counts["completed"])
                                         / max(counts["decode_steps"], 1), 4)
                                   if served else None),
             "acceptance_rate_per_position": stats.get("acceptance_rate_per_position")}
  with open(output_path + ".summary.json", "w") as f:
    json.dump(summary, f, indent=2)
  return summary
