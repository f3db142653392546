"""A training run's workdir: the tokenizer, the tokenized corpus cache, the run's fixed
configuration (a workdir belongs to one model), metrics truncation on resume, and the model
section of a run that starts from a model directory."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from mtp_jax import config as config_lib
from mtp_jax.config import Config
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.formats.tokenizer import Tokenizer, train_bpe
from mtp_jax.training import data as data_lib


def token_cache(workdir: str, name: str, cfg: Config, files: list[str], tokenizer: Tokenizer):
  """Tokenized corpus split, cached in the workdir (numpy .npy, no pickle)."""
  fingerprint = json.dumps({"files": files, "root": data_lib.corpus_root(cfg.data),
                            "tokenizer": tokenizer.hf.to_str()}, sort_keys=True)
  key = str(abs(hash_str(fingerprint)))
  path = os.path.join(workdir, f"tokens_{name}_{key}.npy")
  if os.path.exists(path):
    return np.load(path, allow_pickle=False)
  tokens = data_lib.tokenize_files(cfg.data, files, tokenizer)
  tmp = path + ".tmp.npy"
  np.save(tmp, tokens, allow_pickle=False)
  os.replace(tmp, path)
  return tokens


def hash_str(s: str) -> int:
  return int.from_bytes(hashlib.sha1(s.encode()).digest()[:8], "little")


def load_or_train_tokenizer(cfg: Config, workdir: str, train_files: list[str]) -> Tokenizer:
  path = os.path.join(workdir, "tokenizer.json")
  if cfg.train.init_from or cfg.data.tokenizer:
    src = cfg.data.tokenizer or cfg.train.init_from
    tok = ckpt_lib.load_tokenizer(src)
  elif os.path.exists(path):
    tok = Tokenizer.load(path)
  else:
    texts = data_lib.iter_texts(cfg.data, train_files, cfg.data.tokenizer_train_bytes)
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


def check_run_config(workdir: str, cfg: Config):
  """A workdir belongs to one model: resuming with a different model or data config is refused
  (train fields such as steps may change)."""
  path = os.path.join(workdir, "run_config.json")
  # A run may resume on another mesh: the mesh is not part of what a workdir is bound to.
  fixed = {k: v for k, v in cfg.to_dict().items() if k not in ("train", "mesh")}
  fixed["train.mode"] = cfg.train.mode
  fixed["train.seed"] = cfg.train.seed
  fixed["train.batch_size"] = cfg.train.batch_size
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old != json.loads(json.dumps(fixed)):
      diff = sorted(k for k in set(old) | set(fixed) if old.get(k) != json.loads(json.dumps(fixed)).get(k))
      raise ValueError(f"--workdir={workdir} holds a run with a different configuration "
                       f"(differs in: {diff}); use a new workdir")
  else:
    with open(path, "w") as f:
      json.dump(fixed, f, indent=2)


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
