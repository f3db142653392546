"""Chat templates: an instruct model's conversation format, rendered as HF transformers renders it.

A template is Jinja2 source (the model's `chat_template`), run in Jinja2's immutable sandbox with
HF's conventions: `trim_blocks` and `lstrip_blocks`, the loop controls, `raise_exception(msg)`,
a `tojson` filter that keeps non-ASCII characters, `strftime_now(fmt)`, and the tokenizer's special
tokens (`bos_token`, `eos_token`, ...) as variables beside `messages` and
`add_generation_prompt`. The rendered text is encoded without the tokenizer's own special-token
additions (it holds them already), as `apply_chat_template(..., tokenize=True)` encodes it.

Messages follow the OpenAI chat format: `{"role": "system" | "user" | "assistant", "content": str
or a list of text parts {"type": "text", "text": str}}`; text parts are joined with newlines
(vLLM's rendering of text parts for templates that read a string).

In a model directory the template lives in `chat_template.jinja`; the special tokens it reads
(`chat_tokens`) and the extra tokens that end a generation (`stop_tokens`, e.g. the end-of-turn
token `<|im_end|>` or `<|eot_id|>`) in config.json's `tokenizer` section.
"""

from __future__ import annotations

import datetime
import functools
import json
import os

TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant", "developer", "tool")
# The special tokens HF passes to a template (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES).
TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
               "mask_token")


class ChatError(ValueError):
  """A conversation that cannot be rendered: bad messages, no template, or the template raised.
  The message says which."""


@functools.lru_cache(maxsize=16)
def _compile(template: str):
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ChatError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None


def check_template(template: str, source: str = "chat template") -> str:
  """The template, once it compiles; else ChatError naming the source and the line."""
  try:
    _compile(template)
  except ChatError as e:
    raise ChatError(f"{source}: {e}") from None
  return template


def check_messages(messages, where: str = "messages") -> list[dict]:
  """OpenAI-style messages -> plain dicts of role and content (text parts joined), the keys a
  template may read beside them kept. Raises ChatError naming the message and field."""
  if not isinstance(messages, list) or not messages:
    raise ChatError(f"{where}: must be a non-empty list of messages")
  out = []
  for i, m in enumerate(messages):
    at = f"{where}[{i}]"
    if not isinstance(m, dict):
      raise ChatError(f"{at}: a message must be a JSON object")
    role = m.get("role")
    if role not in ROLES:
      raise ChatError(f"{at}.role={role!r}: must be one of {list(ROLES)}")
    content = m.get("content")
    if isinstance(content, list):
      texts = []
      for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
            part.get("text"), str):
          kind = part.get("type") if isinstance(part, dict) else type(part).__name__
          raise ChatError(f"{at}.content[{j}]: only text parts "
                          f"({{\"type\": \"text\", \"text\": ...}}) are supported, got {kind!r}")
        texts.append(part["text"])
      content = "\n".join(texts)
    elif not isinstance(content, str):
      raise ChatError(f"{at}.content: must be a string or a list of text parts "
                      f"(got {type(content).__name__})")
    out.append({**{k: v for k, v in m.items() if v is not None}, "role": role,
                "content": content})
  return out


def render(template: str | None, messages, tokens: dict | None = None,
           add_generation_prompt: bool = True) -> str:
  """The conversation as the model reads it. tokens: the special tokens by name (bos_token, ...).
  Raises ChatError when there is no template, a message is malformed, or the template raises."""
  if not template:
    raise ChatError("the model has no chat template (import an instruct model with its "
                    "tokenizer_config.json, or pass --chat_template=FILE)")
  import jinja2
  msgs = check_messages(messages)
  compiled = _compile(template)
  try:
    return compiled.render(messages=msgs, tools=None, documents=None,
                           add_generation_prompt=add_generation_prompt, **(tokens or {}))
  except jinja2.exceptions.TemplateError as e:
    raise ChatError(f"chat template raised: {e}") from None
  except Exception as e:  # a template's own arithmetic or indexing on these messages
    raise ChatError(f"chat template failed on these messages ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------- HF files


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def read_hf(hf_dir: str) -> tuple[str | None, dict]:
  """-> (the chat template, the special tokens by name) of an HF tokenizer directory: the
  template from chat_template.jinja, else tokenizer_config.json's `chat_template` (a string, or a
  list of named templates: 'default'); tokens from tokenizer_config.json."""
  config_path = os.path.join(hf_dir, "tokenizer_config.json")
  config = {}
  if os.path.exists(config_path):
    try:
      with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ChatError(f"{config_path}: cannot be read ({e})") from None
  template = None
  jinja_path = os.path.join(hf_dir, TEMPLATE_FILE)
  if os.path.exists(jinja_path):
    with open(jinja_path, encoding="utf-8") as f:
      template = f.read()
  elif isinstance(config.get("chat_template"), str):
    template = config["chat_template"]
  elif isinstance(config.get("chat_template"), list):
    named = {t.get("name"): t.get("template") for t in config["chat_template"]
             if isinstance(t, dict)}
    template = named.get("default")
  tokens = {name: _token_text(config.get(name)) for name in TOKEN_NAMES}
  return template, {k: v for k, v in tokens.items() if v}


def hf_tokenizer_config(template: str | None, tokens: dict, eod_token: str,
                        pad_token: str) -> dict:
  """tokenizer_config.json for an exported model: what transformers' fast tokenizer reads."""
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            **tokens}
  config.setdefault("eos_token", eod_token)
  config.setdefault("pad_token", pad_token)
  if template:
    config["chat_template"] = template
  return config
