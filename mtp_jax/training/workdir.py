"""A training run's workdir: the tokenizer, the tokenized corpus cache (files or JSONL), the run's
fixed configuration (a workdir belongs to one model), metrics truncation on resume, and the model
section of a run that starts from a model directory."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Iterable

import numpy as np

from mtp_jax import config as config_lib
from mtp_jax.config import Config
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.formats.tokenizer import Tokenizer, train_bpe
from mtp_jax.training import data as data_lib
from mtp_jax.training import jsonl


def load_corpus(cfg: Config, workdir: str, window: int):
  """-> (tokenizer, train tokens, held-out tokens, prompt rows or None): the corpus of either
  format tokenized (cached in the workdir). Prompt rows (jsonl.prompt_rows) only for a JSONL
  corpus in heads_only training on the trunk's own text (distill_source='generated'); a corpus of
  files gives its prompts from the train stream's windows."""
  if cfg.data.format == "jsonl":
    return _load_jsonl(cfg, workdir, window)
  train_files, heldout_files = data_lib.split_files(cfg.data)
  texts = data_lib.iter_texts(cfg.data, train_files, cfg.data.tokenizer_train_bytes)
  tokenizer = load_or_train_tokenizer(cfg, workdir, texts)
  train = token_cache(workdir, "train", cfg, train_files, tokenizer)
  heldout = (token_cache(workdir, "heldout", cfg, heldout_files, tokenizer)
             if heldout_files else np.zeros((0,), np.int32))
  return tokenizer, train, heldout, None


def _load_jsonl(cfg: Config, workdir: str, window: int):
  """The JSONL corpus: records are read (and every line checked) only when a cache is built; the
  caches are keyed by the file's content, the split and the tokenizer with its chat template."""
  path, dc = cfg.data.path, cfg.data
  split = functools.cache(lambda: jsonl.split_records(jsonl.read_records(path),
                                                      dc.heldout_permille))

  def texts():                     # read only to train a tokenizer (one without a chat template)
    train, heldout = split()
    jsonl.check_no_messages(path, train + heldout)
    yield from jsonl.iter_texts(train, dc.tokenizer_train_bytes)

  tokenizer = load_or_train_tokenizer(cfg, workdir, texts())
  fingerprint = {"format": "jsonl", "path": os.path.abspath(path), "sha1": jsonl.file_sha1(path),
                 "heldout_permille": dc.heldout_permille, "tokenizer": tokenizer.hf.to_str(),
                 "special": tokenizer.special_tokens(), "chat_template": tokenizer.chat_template}
  train = cached_array(workdir, "train", fingerprint,
                       lambda: jsonl.tokenize_records(path, split()[0], tokenizer))
  heldout = cached_array(workdir, "heldout", fingerprint,
                         lambda: jsonl.tokenize_records(path, split()[1], tokenizer))
  prompts = None
  if cfg.train.mode == "heads_only" and cfg.train.distill_source == "generated":
    p = cfg.train.distill_prompt_len
    prompts = cached_array(workdir, "prompts", {**fingerprint, "prompt_len": p, "window": window},
                           lambda: jsonl.prompt_rows(path, split()[0], tokenizer, p, window))
  return tokenizer, train, heldout, prompts


def token_cache(workdir: str, name: str, cfg: Config, files: list[str], tokenizer: Tokenizer):
  """Tokenized corpus split, cached in the workdir (numpy .npy, no pickle)."""
  fingerprint = {"files": files, "root": data_lib.corpus_root(cfg.data),
                 "tokenizer": tokenizer.hf.to_str()}
  return cached_array(workdir, name, fingerprint,
                      lambda: data_lib.tokenize_files(cfg.data, files, tokenizer))


def cached_array(workdir: str, name: str, fingerprint: dict, build) -> np.ndarray:
  """workdir/tokens_{name}_{key}.npy, key a hash of `fingerprint` (what the array is made from):
  loaded when there, else `build()` written atomically."""
  key = str(abs(hash_str(json.dumps(fingerprint, sort_keys=True))))
  path = os.path.join(workdir, f"tokens_{name}_{key}.npy")
  if os.path.exists(path):
    return np.load(path, allow_pickle=False)
  tokens = build()
  tmp = path + ".tmp.npy"
  np.save(tmp, tokens, allow_pickle=False)
  os.replace(tmp, path)
  return tokens


def hash_str(s: str) -> int:
  return int.from_bytes(hashlib.sha1(s.encode()).digest()[:8], "little")


def load_or_train_tokenizer(cfg: Config, workdir: str, texts: Iterable[str]) -> Tokenizer:
  """A model directory's tokenizer (data.tokenizer, else train.init_from), the workdir's, or one
  trained on `texts` (read only then)."""
  path = os.path.join(workdir, "tokenizer.json")
  if cfg.train.init_from or cfg.data.tokenizer:
    src = cfg.data.tokenizer or cfg.train.init_from
    tok = ckpt_lib.load_tokenizer(src)
  elif os.path.exists(path):
    tok = Tokenizer.load(path)
  else:
    tok = train_bpe(texts, cfg.model.vocab_size)
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                     f"{tok.vocab_size} tokens")
  tok.save(path)
  return tok


def init_from_model_section(model_dir: str) -> dict:
  """The model section of a model directory's config.json, for a run that starts from it."""
  path = os.path.join(model_dir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"train.init_from={model_dir!r}: no config.json there (not a model directory)")
  with open(path) as f:
    text = f.read()
  mcfg, _ = config_lib.load_model_dir_config(text, path)
  return dataclasses.asdict(mcfg)


def check_run_config(workdir: str, cfg: Config, write: bool = True):
  """A workdir belongs to one model and corpus: resuming with a different model or data config,
  or a changed JSONL file, is refused (train fields such as steps may change). A new workdir's
  run config is written unless write=False (the caller writes it once the corpus has loaded, so
  that a corpus that fails to load binds the workdir to nothing)."""
  path = os.path.join(workdir, "run_config.json")
  # A run may resume on another mesh: the mesh is not part of what a workdir is bound to.
  fixed = {k: v for k, v in cfg.to_dict().items() if k not in ("train", "mesh")}
  fixed["train.mode"] = cfg.train.mode
  fixed["train.seed"] = cfg.train.seed
  fixed["train.batch_size"] = cfg.train.batch_size
  if cfg.data.format == "jsonl":
    fixed["data.sha1"] = jsonl.file_sha1(cfg.data.path)
  fixed = json.loads(json.dumps(fixed))
  if os.path.exists(path):
    with open(path) as f:
      old = _with_defaults(json.load(f))
    if old != fixed:
      diff = sorted(k for k in set(old) | set(fixed) if old.get(k) != fixed.get(k))
      raise ValueError(f"--workdir={workdir} holds a run with a different configuration "
                       f"(differs in: {diff}); use a new workdir")
  elif write:
    with open(path, "w") as f:
      json.dump(fixed, f, indent=2)


def _with_defaults(old: dict) -> dict:
  """A stored run config with the fields added to its sections since, at their defaults."""
  defaults = json.loads(json.dumps(Config().to_dict()))
  return {k: {**defaults[k], **v} if k in defaults and isinstance(v, dict) else v
          for k, v in old.items()}


def truncate_metrics(path: str, last_step: int):
  """Drops metric lines written after the checkpoint a resumed run starts from."""
  if not os.path.exists(path):
    return
  keep = []
  with open(path) as f:
    for line in f:
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut by a kill
      if rec.get("step", 0) <= last_step:
        keep.append(line if line.endswith("\n") else line + "\n")
  with open(path, "w") as f:
    f.writelines(keep)
