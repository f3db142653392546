"""Instruct models end to end against transformers: tiny Qwen2- and Llama-3-style models saved
with chat templates of their own (loops, role conditions, a system default, raise_exception,
bos_token, add_generation_prompt), imported with their templates and end tokens; conversations
render to transformers' tokens; export gives them back; the batch job serves chat lines."""

import json
import os

import pytest

torch = pytest.importorskip("torch", reason="the hf-test extra (make test installs it)")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from mtp_jax.config import DecodeConfig, HeadsConfig  # noqa: E402
from mtp_jax.formats import chat  # noqa: E402
from mtp_jax.formats import checkpoint as ckpt_lib  # noqa: E402
from mtp_jax.formats import hf as hf_lib  # noqa: E402
from mtp_jax.formats.tokenizer import Tokenizer as OurTokenizer  # noqa: E402
from mtp_jax.serving import api, batch  # noqa: E402
from tests.helpers import killed_and_resumed  # noqa: E402

TEXT = "def add(x, y):\n    return x + y\n\nHello, how are you? I am fine, thank you.\n"
QWEN = ("{%- if messages[0]['role'] == 'system' -%}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if loop.first and message.role == 'system' -%}{%- continue -%}{%- endif -%}"
        "{%- if message.role not in ['user', 'assistant'] -%}"
        "{{- raise_exception('Unknown role: ' + message.role) -}}{%- endif -%}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
LLAMA = ("{{- bos_token -}}{%- set ns = namespace(last='') -%}"
         "{%- for message in messages -%}"
         "{%- if message.role == ns.last -%}"
         "{{- raise_exception('Conversation roles must alternate') -}}{%- endif -%}"
         "{%- set ns.last = message.role -%}"
         "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
         "message['content'] | trim + '<|eot_id|>' -}}"
         "{%- endfor -%}"
         "{%- if add_generation_prompt -%}"
         "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}")
# family, special tokens, the bos the tokenizer adds, template, tokenizer_config's tokens, eos id
# of config.json, of generation_config.json
MODELS = {
    "qwen": ("Qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, QWEN,
             dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"), 0, None),
    "llama": ("Llama", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", LLAMA,
              dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"), 1, [1, 4]),
}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello, how are you?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(x, y):"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "I am fine."},
     {"role": "user", "content": [{"type": "text", "text": "thank"}, {"type": "text",
                                                                       "text": "you"}]}],
]


def _build(root, name):
  family, specials, bos, template, tok_kw, eos_id, gen_eos = MODELS[name]
  path = os.path.join(root, name)
  raw = Tokenizer(models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  raw.train_from_iterator([TEXT] * 20, trainer=trainers.BpeTrainer(
      vocab_size=300, special_tokens=specials, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  if bos:
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                       special_tokens=[(bos, 0)])
  cfg = getattr(transformers, f"{family}Config")(
      vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
      eos_token_id=eos_id, bos_token_id=0, tie_word_embeddings=True)
  torch.manual_seed(len(name))
  getattr(transformers, f"{family}ForCausalLM")(cfg).eval().save_pretrained(path)
  hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, **tok_kw)
  hf_tok.chat_template = template
  hf_tok.save_pretrained(path)
  if gen_eos:
    with open(os.path.join(path, "generation_config.json"), "w") as f:
      json.dump({"eos_token_id": gen_eos}, f)
  return hf_tok, path


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  root = tmp_path_factory.mktemp("chat")
  out = {}
  for name in MODELS:
    hf_tok, path = _build(str(root), name)
    ours = str(root / f"{name}_ours")
    hf_lib.import_model(path, ours, HeadsConfig(num=2))
    out[name] = hf_tok, path, ours
  return out


def _hf_ids(hf_tok, messages):
  """transformers' tokens of a conversation; text parts joined by newlines first, as mtp-jax
  (and vLLM, for templates that read a string) renders them."""
  flat = [dict(m, content="\n".join(p["text"] for p in m["content"]))
          if isinstance(m["content"], list) else m for m in messages]
  return list(hf_tok.apply_chat_template(flat, add_generation_prompt=True,
                                         tokenize=True)["input_ids"])


@pytest.mark.parametrize("name", list(MODELS))
def test_import_keeps_the_template_and_conversations_render_as_transformers(imported, name):
  hf_tok, _, ours = imported[name]
  tok = ckpt_lib.load_tokenizer(ours)
  assert os.path.exists(os.path.join(ours, chat.TEMPLATE_FILE))
  assert tok.chat_template == MODELS[name][3]
  # The end tokens: Qwen's end of turn is tokenizer_config's eos_token, Llama's in
  # generation_config's eos_token_id; the end of document stays config.json's.
  assert (tok.eod_token, tok.stop_tokens) == {
      "qwen": ("<|endoftext|>", ("<|im_end|>",)),
      "llama": ("<|end_of_text|>", ("<|eot_id|>",))}[name]
  for conv in CONVERSATIONS:
    assert tok.encode_chat(conv) == _hf_ids(hf_tok, conv)
  bad = {"qwen": ([{"role": "tool", "content": "x"}], "Unknown role: tool"),
         "llama": ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                   "Conversation roles must alternate")}[name]
  with pytest.raises(chat.ChatError, match="chat template raised: " + bad[1]):
    tok.encode_chat(bad[0])
  with pytest.raises(Exception, match=bad[1]):
    _hf_ids(hf_tok, bad[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_export_writes_the_template_back(imported, tmp_path, name):
  hf_tok, _, ours = imported[name]
  exp = str(tmp_path / "exp")
  files = hf_lib.export_model(ours, exp)
  assert "tokenizer_config.json" in files
  back = transformers.AutoTokenizer.from_pretrained(exp)
  for conv in CONVERSATIONS:
    assert _hf_ids(back, conv) == _hf_ids(hf_tok, conv)
  tok = ckpt_lib.load_tokenizer(ours)
  if tok.stop_tokens:
    gen = json.load(open(os.path.join(exp, "generation_config.json")))
    assert gen["eos_token_id"] == list(tok.end_ids)
  hf_lib.import_model(exp, str(tmp_path / "again"), HeadsConfig(num=2))
  again = ckpt_lib.load_tokenizer(str(tmp_path / "again"))
  assert (again.chat_template, again.end_ids) == (tok.chat_template, tok.end_ids)


def _decoder(model_dir, k, tok=None):
  mcfg, hcfg, params, loaded = ckpt_lib.load_model_dir(model_dir)
  return api.Decoder(mcfg, hcfg, params, tok or loaded,
                     DecodeConfig(batch_size=2, k=k, ring_size=8, max_len=128))


def _chat_line(cid, messages, **body):
  return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "m", "messages": messages, **body}})


def test_chat_lines_end_to_end(imported, tmp_path):
  """Greedy speculative output equals plain on chat lines of both forms; chat.completion records;
  a line the template refuses, or bad messages, become error records; the others complete."""
  _, _, ours = imported["qwen"]
  lines = [_chat_line(f"c{i}", conv, max_completion_tokens=12, temperature=0)
           for i, conv in enumerate(CONVERSATIONS)]
  lines += [json.dumps({"id": "p", "messages": CONVERSATIONS[1], "max_new_tokens": 10}),
            _chat_line("bad_role", [{"role": "tool", "content": "x"}]),
            _chat_line("no_messages", []),
            _chat_line("both", CONVERSATIONS[0], max_tokens=3, max_completion_tokens=4),
            json.dumps({"custom_id": "cp", "url": "/v1/chat/completions",
                        "body": {"prompt": "x"}})]
  inp = tmp_path / "in.jsonl"
  inp.write_text("\n".join(lines) + "\n")
  outs = {}
  for k in (0, 2):
    out = tmp_path / f"out{k}.jsonl"
    batch.run_job(_decoder(ours, k), str(inp), str(out), batch.Defaults(max_new_tokens=8))
    outs[k] = {r.get("custom_id", r["id"]): r for r in map(json.loads, out.read_text().split(
        "\n")[:-1])}
  plain, spec = outs[0], outs[2]
  assert set(plain) == set(spec) and len(plain) == len(lines)
  for cid in ("c0", "c1", "c2"):
    body = spec[cid]["response"]["body"]
    assert body["object"] == "chat.completion" and spec[cid]["error"] is None
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg == plain[cid]["response"]["body"]["choices"][0][
        "message"]
    assert body["usage"]["completion_tokens"] <= 12
  tok = ckpt_lib.load_tokenizer(ours)
  assert spec["c1"]["response"]["body"]["usage"]["prompt_tokens"] == len(
      tok.encode_chat(CONVERSATIONS[1]))
  assert spec["p"]["text"] == plain["p"]["text"] and spec["p"]["error"] is None
  err = lambda cid: spec[cid]["error"]["message"]
  assert err("bad_role") == "body.chat template raised: Unknown role: tool"
  assert err("no_messages") == "body.messages: must be a non-empty list of messages"
  assert "give it or max_tokens, not both" in err("both")
  assert "takes messages, not a prompt" in err("cp")


def test_the_end_of_turn_token_ends_a_row(imported):
  """A row ends at the first end token the device emits, whichever of end_ids it is: here the
  token plain decoding writes fourth, named the end of turn."""
  _, _, ours = imported["qwen"]
  plain = _decoder(ours, 0)
  prompt = plain.tokenizer.encode_chat(CONVERSATIONS[0])
  free = plain.run([api.Request(prompt, 12)])[0].token_ids
  assert len(free) == 12
  stop = plain.tokenizer.hf.id_to_token(free[3])
  j = free.index(free[3])
  tok = OurTokenizer(plain.tokenizer.hf, eod_token="<|endoftext|>", stop_tokens=[stop])
  for k in (0, 2):
    c = _decoder(ours, k, tok).run([api.Request(prompt, 12)])[0]
    assert c.token_ids == free[:j] and c.finish_reason == "stop", k


@pytest.mark.slow
def test_chat_job_killed_with_sigkill_resumes_exactly_once(imported, tmp_path):
  _, _, ours = imported["llama"]
  inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
  n = 120
  inp.write_text("".join(_chat_line(f"r{i}", CONVERSATIONS[i % 3], max_tokens=16) + "\n"
                         for i in range(n)))
  args = [f"--model={ours}", f"--input={inp}", f"--output={out}", "--k=2", "--batch_size=2",
          "--quiet"]
  recs = killed_and_resumed(args, out, n)
  assert sorted(r["custom_id"] for r in recs) == sorted(f"r{i}" for i in range(n))
  assert all(r["error"] is None and r["response"]["body"]["object"] == "chat.completion"
             for r in recs)
