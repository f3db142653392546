"""The OpenAI batch API's request lines and output records, as vLLM's run-batch serves them.

A request line: {"custom_id": ..., "method": "POST", "url": URL, "body": {...}} with URL
  /v1/completions        body: prompt (a string, or a list of one), max_tokens, temperature,
                         top_p, stop, seed, top_k, repetition_penalty
  /v1/chat/completions   body: messages (role system / user / assistant; content a string or a
                         list of text parts), max_tokens or max_completion_tokens, temperature,
                         top_p, stop, seed, top_k, repetition_penalty
and n = 1. A chat request is rendered with the model's chat template (formats/chat.py) and ends at
the model's end-of-turn token as well as at its end-of-document token. Its output record carries a
chat.completion body (choices[0].message with role and content); a completion's a text_completion
body. Both hold `usage` and mtp-jax's `spec` (decode steps and acceptance length).
"""

from __future__ import annotations

import time

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
URLS = (COMPLETIONS, CHAT)

# body field -> the plain line's field
_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}
# Accepted and not used: they change nothing a batch job returns (n must be 1).
_IGNORED = {"model", "n", "stream", "logprobs", "echo", "user", "best_of", "suffix",
            "presence_penalty", "frequency_penalty", "stream_options", "top_logprobs",
            "parallel_tool_calls", "store", "metadata"}


def fields(obj: dict, line_no: int, known: set):
  """A request line -> (custom_id, the plain line's fields, chat: bool) or (custom_id, error,
  None). known: the plain fields a body may set."""
  cid = obj.get("custom_id")
  if not isinstance(cid, str) or not cid:
    return f"line {line_no}", "custom_id: missing or not a non-empty string", None
  if obj.get("method", "POST") != "POST":
    return cid, f"method={obj.get('method')!r}: only POST is supported", None
  url = obj.get("url")
  if url not in URLS:
    return cid, f"url={url!r}: must be one of {list(URLS)}", None
  chat = url == CHAT
  body = obj.get("body")
  if not isinstance(body, dict):
    return cid, "body: missing or not a JSON object", None
  if chat and "prompt" in body:
    return cid, f"body.prompt: {CHAT} takes messages, not a prompt", None
  if not chat and "messages" in body:
    return cid, f"body.messages: {COMPLETIONS} takes a prompt (use {CHAT})", None
  if "max_tokens" in body and "max_completion_tokens" in body:
    return cid, "body.max_completion_tokens: give it or max_tokens, not both", None
  out = {}
  for name, v in body.items():
    if name in _IGNORED:
      if name == "n" and v != 1:
        return cid, f"body.n={v!r}: only n=1 is supported", None
      continue
    plain = _NAMES.get(name, name)
    if plain not in known:
      return cid, f"body.{name}: unknown field", None
    out[plain] = v
  if isinstance(out.get("prompt"), list):
    p = out["prompt"]
    if len(p) != 1 or not isinstance(p[0], str):
      return cid, "body.prompt: a list prompt must hold exactly one string", None
    out["prompt"] = p[0]
  return cid, out, chat


def shown_name(name: str, body: dict) -> str:
  """The body's own name of a plain field, for error messages."""
  if name == "max_new_tokens":
    return "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
  return name


def record(line: int, custom_id, chat: bool, c=None, error: str | None = None, spec=None,
           model: str = "mtp-jax") -> dict:
  """The output record of one request line: a completion (c, an api.Completion, and spec) or an
  error."""
  rid = f"batch_req_{line}"
  if c is None:
    return {"id": rid, "custom_id": custom_id,
            "response": {"status_code": 400, "request_id": rid, "body": None},
            "error": {"code": "invalid_request", "message": error}}
  usage = {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.token_ids),
           "total_tokens": c.prompt_tokens + len(c.token_ids)}
  if chat:
    choice = {"index": 0, "message": {"role": "assistant", "content": c.text},
              "logprobs": None, "finish_reason": c.finish_reason}
    head = {"id": f"chatcmpl-{line}", "object": "chat.completion"}
  else:
    choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
    head = {"id": f"cmpl-{line}", "object": "text_completion"}
  body = {**head, "created": int(time.time()), "model": model, "choices": [choice],
          "usage": usage, "spec": spec}
  return {"id": rid, "custom_id": custom_id,
          "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}
