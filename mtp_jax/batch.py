"""The batch job's file formats: JSONL requests in, one JSONL record per input line out.

Input lines are `{"id": ..., "prompt": "...", "max_new_tokens": N, "temperature": T, "top_p": P,
"top_k": K, "repetition_penalty": R, "stop": ["..."]}` (all but id and prompt optional). A line
that cannot be served becomes an error record naming the problem; it never stops the job. Output
records are appended and flushed as rows finish; a rerun skips ids already in the output, so an
interrupted job resumes and every id ends up exactly once.
"""

from __future__ import annotations

import dataclasses
import json
import os

from mtp_jax.api import Completion, Request


@dataclasses.dataclass
class Defaults:
  max_new_tokens: int = 128
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  repetition_penalty: float = 1.0


@dataclasses.dataclass
class Item:
  line: int
  id: object
  request: Request | None = None
  stop: tuple = ()
  error: str | None = None


_NUMBERS = {"max_new_tokens": int, "top_k": int, "temperature": float, "top_p": float,
            "repetition_penalty": float}


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
  return None


def parse_line(raw: bytes, line_no: int, defaults: Defaults, tokenizer, max_prompt: int,
               max_new_cap: int) -> Item:
  """One input line -> an Item with a Request, or with an error naming the problem."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    return Item(line_no, line_no, error=f"line {line_no}: not valid UTF-8 ({e.reason} at byte {e.start})")
  try:
    obj = json.loads(text)
  except json.JSONDecodeError as e:
    return Item(line_no, line_no, error=f"line {line_no}: not valid JSON ({e.msg} at column {e.colno})")
  if not isinstance(obj, dict):
    return Item(line_no, line_no, error=f"line {line_no}: a request must be a JSON object")
  rid = obj.get("id", line_no)
  if not isinstance(rid, (str, int)) or isinstance(rid, bool):
    return Item(line_no, line_no, error=f"line {line_no}: id must be a string or an integer")
  prompt = obj.get("prompt")
  if not isinstance(prompt, str):
    return Item(line_no, rid, error=f"prompt: missing or not a string (got {type(prompt).__name__})")
  if not prompt:
    return Item(line_no, rid, error="prompt: empty")
  params = dataclasses.asdict(defaults)
  for name, typ in _NUMBERS.items():
    if name not in obj:
      continue
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not isinstance(v, int)):
      return Item(line_no, rid, error=f"{name}={v!r}: must be {'an integer' if typ is int else 'a number'}")
    params[name] = typ(v)
  for name, v in params.items():
    err = _check(name, v, max_new_cap)
    if err:
      return Item(line_no, rid, error=err)
  stop = obj.get("stop", [])
  if isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
    return Item(line_no, rid, error="stop: must be a non-empty string or a list of them")
  ids = tokenizer.encode(prompt)
  if len(ids) > max_prompt:
    return Item(line_no, rid, error=f"prompt: {len(ids)} tokens, longer than the {max_prompt} "
                                    "the context allows")
  return Item(line_no, rid, Request(ids, **params), tuple(stop))


def load_done(path: str) -> set:
  """Ids already written to the output. A last line cut by a kill is removed first."""
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
      done.add(json.dumps(json.loads(line)["id"]))
    except (json.JSONDecodeError, KeyError, TypeError):
      continue
  return done


def apply_stop(c: Completion, stop: tuple) -> tuple[str, str]:
  text, reason = c.text, c.finish_reason
  cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
  if cut >= 0:
    text, reason = text[:cut], "stop"
  return text, reason


def record(item: Item, c: Completion | None = None) -> dict:
  if c is None:
    return {"id": item.id, "text": None, "finish_reason": "error",
            "usage": {"prompt_tokens": 0, "completion_tokens": 0}, "spec": None,
            "error": item.error}
  text, reason = apply_stop(c, item.stop)
  return {"id": item.id, "text": text, "finish_reason": reason,
          "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids)},
          "spec": {"steps": c.steps, "acceptance_length": round(c.acceptance_length, 4)},
          "error": None}


def run_job(decoder, input_path: str, output_path: str, defaults: Defaults, log=None) -> dict:
  """Serves every line of input_path not yet in output_path; returns the summary."""
  import time
  t0 = time.perf_counter()
  eng = decoder.engine
  max_prompt = eng.cfg.max_len - eng.kd - 2
  max_new_cap = eng.cfg.max_len
  done_ids = load_done(output_path)
  items, seen = [], set()
  with open(input_path, "rb") as f:
    for no, raw in enumerate(f, start=1):
      if not raw.strip():
        continue
      item = parse_line(raw.rstrip(b"\r\n"), no, defaults, decoder.tokenizer, max_prompt,
                        max_new_cap)
      key = json.dumps(item.id)
      if key in done_ids:
        continue
      if key in seen:
        item = Item(no, item.id, error=f"line {no}: duplicate id {item.id!r}")
        key = json.dumps(f"line {no}")
        item.id = f"line {no}"
      seen.add(key)
      items.append(item)
  served = [it for it in items if it.request is not None]
  counts = {"skipped_done": len(done_ids), "errors": 0, "completed": 0, "tokens": 0}
  with open(output_path, "a") as out:
    def write(rec):
      out.write(json.dumps(rec) + "\n")
      out.flush()
    for it in items:
      if it.request is None:
        write(record(it))
        counts["errors"] += 1
    steps = 0

    def on_done(i, c):
      nonlocal steps
      write(record(served[i], c))
      counts["completed"] += 1
      counts["tokens"] += len(c.token_ids)
      steps += c.steps
      if log:
        el = time.perf_counter() - t0
        rate = counts["completed"] / el
        log(f"{counts['completed']}/{len(served)} rows, {counts['tokens'] / el:.1f} tokens/s, "
            f"ETA {(len(served) - counts['completed']) / max(rate, 1e-9):.0f}s")

    if served:
      decoder.run([it.request for it in served], on_done=on_done)
  wall = time.perf_counter() - t0
  summary = {**counts, "rows": len(items), "wall_s": round(wall, 3),
             "tokens_per_s": round(counts["tokens"] / wall, 2) if wall else 0.0,
             "acceptance_length": decoder.last_stats.get("acceptance_length") if served else None,
             "acceptance_rate_per_position":
                 decoder.last_stats.get("acceptance_rate_per_position") if served else None}
  with open(output_path + ".summary.json", "w") as f:
    json.dump(summary, f, indent=2)
  return summary
