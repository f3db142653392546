"""Byte-level BPE with HF `tokenizers`: train on a corpus, save and load `tokenizer.json`; the
special tokens that end a generation; an instruct model's chat template."""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mtp_jax.formats import chat

EOD = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOD, PAD)


class Tokenizer:
  """A thin wrapper that knows the special tokens the product relies on.

  `eod_token` ends a document and a generation (an imported model's EOS token); `pad_token`
  falls back to it when the vocabulary has none. `stop_tokens`: further tokens that end a
  generation (an instruct model's end-of-turn token); `end_ids` holds them all, eod first. An
  instruct model's `chat_template` renders conversations (chat.py) with `chat_tokens`, the
  special tokens it reads by name (bos_token, eos_token, ...)."""

  def __init__(self, hf: HFTokenizer, source: str = "<memory>", eod_token: str = EOD,
               pad_token: str = PAD, stop_tokens: Sequence[str] = (),
               chat_tokens: dict | None = None, chat_template: str | None = None):
    self.hf = hf
    self.eod_token, self.pad_token = eod_token, pad_token
    self.eod_id = hf.token_to_id(eod_token)
    self.pad_id = hf.token_to_id(pad_token)
    if self.eod_id is None:
      raise ValueError(f"{source}: tokenizer has no end-of-document token {eod_token!r}")
    if self.pad_id is None:
      self.pad_token, self.pad_id = eod_token, self.eod_id
    self.stop_tokens = tuple(t for t in dict.fromkeys(stop_tokens) if t != eod_token)
    stop_ids = [hf.token_to_id(t) for t in self.stop_tokens]
    missing = [t for t, i in zip(self.stop_tokens, stop_ids) if i is None]
    if missing:
      raise ValueError(f"{source}: tokenizer has no stop token {missing[0]!r}")
    self.end_ids = (self.eod_id, *stop_ids)
    self.chat_tokens = dict(chat_tokens or {})
    self.chat_template = chat_template or None

  def special_tokens(self) -> dict:
    """What a model directory's config.json keeps of the tokenizer (Tokenizer.load's keywords;
    the template goes to a file of its own)."""
    out = {"eod_token": self.eod_token, "pad_token": self.pad_token}
    if self.stop_tokens:
      out["stop_tokens"] = list(self.stop_tokens)
    if self.chat_tokens:
      out["chat_tokens"] = dict(self.chat_tokens)
    return out

  def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
    """A conversation's token ids as the model's chat template renders it (chat.render); the
    rendered text holds its special tokens, so none are added. Raises chat.ChatError."""
    text = chat.render(self.chat_template, messages, self.chat_tokens, add_generation_prompt)
    return self.hf.encode(text, add_special_tokens=False).ids

  @property
  def vocab_size(self) -> int:
    return self.hf.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    return self.hf.encode(text).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self.hf.encode_batch(list(texts))]

  def decode(self, ids: Sequence[int]) -> str:
    return self.hf.decode(list(ids), skip_special_tokens=True)

  def save(self, path: str):
    self.hf.save(path)

  @classmethod
  def load(cls, path: str, eod_token: str = EOD, pad_token: str = PAD, stop_tokens=(),
           chat_tokens: dict | None = None, chat_template: str | None = None) -> "Tokenizer":
    if not os.path.exists(path):
      raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
      hf = HFTokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
      raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
    return cls(hf, source=path, eod_token=eod_token, pad_token=pad_token,
               stop_tokens=stop_tokens, chat_tokens=chat_tokens, chat_template=chat_template)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
  """Trains a byte-level BPE (no unknown tokens: every byte has a token) with EOD and PAD."""
  hf = HFTokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  hf.train_from_iterator(texts, trainer=trainer)
  return Tokenizer(hf)
