"""Chat templates without transformers: HF's rendering conventions, message checks and the errors
that name the problem, the tokens that end a generation, and the template's place in a model
directory."""

import os

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from mtp_jax.formats import chat
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.formats.tokenizer import Tokenizer

TEMPLATE = ("{{- bos_token -}}"
            "{%- for m in messages -%}"
            "{%- if m.role == 'system' and not loop.first -%}"
            "{{- raise_exception('a system message must come first') -}}{%- endif -%}"
            "{%- if m.content == 'skip' -%}{%- continue -%}{%- endif -%}"
            "<{{ m.role }}>{{ m.content | trim }}{{ eos_token }}\n"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}<assistant>{%- endif -%}")
TOKENS = {"bos_token": "<s>", "eos_token": "</t>"}


def _tokenizer(**kw):
  vocab = {t: i for i, t in enumerate(["<eod>", "<s>", "</t>", "<pad>", "a", "b", " "])}
  hf = HFTokenizer(models.WordLevel(vocab, unk_token="<pad>"))
  hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  return Tokenizer(hf, eod_token="<eod>", pad_token="<pad>", **kw)


def test_render_follows_hf_conventions():
  msgs = [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "skip"},
          {"role": "user", "content": [{"type": "text", "text": "one"},
                                       {"type": "text", "text": "two"}]}]
  # trim_blocks / lstrip_blocks, loop controls, the special tokens by name, text parts joined.
  assert chat.render(TEMPLATE, msgs, TOKENS) == (
      "<s><system>be brief</t><user>one\ntwo</t><assistant>")
  assert chat.render(TEMPLATE, msgs, TOKENS, add_generation_prompt=False).endswith("two</t>")
  assert chat.render("{% if true %}\nx\n  {% endif %}", msgs) == "x\n"
  assert chat.render("{{ x | tojson }}", [{"role": "user", "content": "é"}], {"x": "é"}) == '"é"'


@pytest.mark.parametrize("messages, message", [
    ([], "messages: must be a non-empty list"),
    ("hi", "messages: must be a non-empty list"),
    ([{"role": "robot", "content": "x"}], "messages[0].role='robot': must be one of"),
    ([{"role": "user"}], "messages[0].content: must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0]: only text parts"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}],
     "chat template raised: a system message must come first"),
])
def test_bad_conversations_name_the_problem(messages, message):
  with pytest.raises(chat.ChatError, match=message.replace("[", r"\[").replace("]", r"\]")):
    chat.render(TEMPLATE, messages, TOKENS)


def test_no_template_and_a_broken_template_say_so():
  msgs = [{"role": "user", "content": "a"}]
  with pytest.raises(chat.ChatError, match="the model has no chat template"):
    _tokenizer().encode_chat(msgs)
  with pytest.raises(chat.ChatError, match="t.jinja: chat template: syntax error at line 1"):
    chat.check_template("{% for %}", "t.jinja")
  with pytest.raises(chat.ChatError, match="list object has no element 5"):
    chat.render("{{ messages[5].content }}", msgs)
  # The sandbox refuses what a template must not do.
  with pytest.raises(chat.ChatError):
    chat.render("{{ messages.append(1) }}", msgs)


def test_stop_tokens_end_generations_and_travel_with_the_model_dir(tmp_path):
  tok = _tokenizer(stop_tokens=["</t>", "<eod>"], chat_tokens=TOKENS, chat_template=TEMPLATE)
  assert tok.end_ids == (0, 2) and tok.stop_tokens == ("</t>",)
  assert tok.encode_chat([{"role": "user", "content": "a b"}]) is not None
  with pytest.raises(ValueError, match="no stop token '<nope>'"):
    _tokenizer(stop_tokens=["<nope>"])
  # save_model_dir writes the template beside tokenizer.json; load_tokenizer reads both back.
  d = tmp_path / "m"
  os.makedirs(d)
  tok.save(str(d / "tokenizer.json"))
  (d / chat.TEMPLATE_FILE).write_text(TEMPLATE)
  (d / "config.json").write_text('{"tokenizer": %s}' % __import__("json").dumps(
      tok.special_tokens()))
  back = ckpt_lib.load_tokenizer(str(d))
  assert back.end_ids == tok.end_ids and back.chat_tokens == TOKENS
  assert back.chat_template == TEMPLATE


def test_read_hf_takes_the_jinja_file_or_the_named_default(tmp_path):
  (tmp_path / "tokenizer_config.json").write_text(
      '{"chat_template": [{"name": "tool_use", "template": "T"}, '
      '{"name": "default", "template": "D"}], "bos_token": {"content": "<s>", "lstrip": false}, '
      '"eos_token": "</t>", "unk_token": null}')
  assert chat.read_hf(str(tmp_path)) == ("D", {"bos_token": "<s>", "eos_token": "</t>"})
  (tmp_path / chat.TEMPLATE_FILE).write_text("J")
  assert chat.read_hf(str(tmp_path))[0] == "J"
