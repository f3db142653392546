"""Llama-family checkpoints of HF transformers: import into a model directory, export back.

Supported architectures: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, as saved
by `save_pretrained(safe_serialization=True)`: `config.json`, `model.safetensors` or a sharded
`model.safetensors.index.json`, and `tokenizer.json`. Weights are read with `safetensors`
(numpy), never with pickle.

Which configs map onto the trunk, and the refusals naming the field: `hf_config.py`. This file
holds the weights: HF names <-> trunk parameters, reading and writing safetensors, the heads file.

An instruct model's chat template and special tokens (`tokenizer_config.json` or
`chat_template.jinja`) and the tokens that end its generations (`generation_config.json`'s
eos_token_id) travel with it (chat.py). Export writes the trunk back under HF names
(`model.safetensors`, `config.json`, `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json`; loadable by transformers) and the heads to `mtp_heads.safetensors`,
which an import of that directory picks up again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

from mtp_jax import config as config_lib
from mtp_jax.config import Config, HeadsConfig, ModelConfig
from mtp_jax.formats import chat
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.formats import hf_mtp
from mtp_jax.formats import hf_weights as W
from mtp_jax.formats.hf_config import (
  HFImportError,
  _fail,
  hf_config_for,
  model_config_from_hf,
  read_hf_config,
)
from mtp_jax.formats.tokenizer import Tokenizer
from mtp_jax.models import model as model_lib

HEADS_FILE = "mtp_heads.safetensors"


def _end_tokens(hf_dir: str, hf: dict, raw, override: str, chat_tokens: dict):
  """-> (the end-of-document token, the further tokens that end a generation). The first comes
  from config.json's eos_token_id (else generation_config.json's); the others are every
  eos_token_id of config.json and generation_config.json (an instruct model lists its end-of-turn
  token there, as Llama 3's <|eot_id|>) and tokenizer_config.json's eos_token (Qwen2's
  <|im_end|>), as transformers' generate and vLLM stop on them all."""
  gen_path = os.path.join(hf_dir, "generation_config.json")
  gen = {}
  if os.path.exists(gen_path):
    with open(gen_path) as f:
      gen = json.load(f)
  as_list = lambda v: v if isinstance(v, list) else [] if v is None else [v]
  ids = as_list(hf.get("eos_token_id")) + as_list(gen.get("eos_token_id"))
  tokens = [raw.id_to_token(i) if isinstance(i, int) else None for i in ids]
  tokens.append(chat_tokens.get("eos_token"))
  eod = override or tokens[0]
  if eod is None:
    source = "config.json" if hf.get("eos_token_id") is not None else "generation_config.json"
    raise HFImportError(f"{source}: eos_token_id={ids[0] if ids else None!r} names no token of "
                        "tokenizer.json; pass --eod_token=TOKEN")
  stops = [t for t in tokens if t is not None and t != eod and raw.token_to_id(t) is not None]
  return eod, tuple(dict.fromkeys(stops))


def import_model(hf_dir: str, out_dir: str, heads_cfg: HeadsConfig, max_seq_len: int = 0,
                 param_dtype: str = "", eod_token: str = "", seed: int = 0,
                 mtp_layout: str = "auto", medusa: str = "",
                 mtp_carry: str = "") -> tuple[ModelConfig, str]:
  """Writes an mtp-jax model directory with the HF trunk and its heads: the MTP layers the
  checkpoint ships (hf_mtp.py; mtp_layout 'auto' finds them, 'none' leaves them out), else
  `heads_cfg`'s (fresh, or the directory's own `mtp_heads.safetensors` when it matches).
  medusa: Medusa heads (a file or directory); mtp_carry: overrides a sequential layout's carry.
  -> (ModelConfig, what happened)."""
  if mtp_layout not in hf_mtp.LAYOUTS:
    _fail("mtp_layout", mtp_layout, f"must be one of {list(hf_mtp.LAYOUTS)}")
  hf = read_hf_config(hf_dir)
  mcfg = model_config_from_hf(hf, max_seq_len, param_dtype)
  tok = _tokenizer(hf_dir, hf, eod_token)
  if tok.vocab_size > mcfg.vocab_size:
    _fail("vocab_size", mcfg.vocab_size, f"is smaller than tokenizer.json's {tok.vocab_size}")
  tensors = W.read_safetensors(hf_dir)
  medusa_file = hf_mtp.medusa_path(hf_dir, medusa)
  found = hf_mtp.detect(hf, tensors, medusa_file)
  layout = found if mtp_layout == "auto" else "" if mtp_layout == "none" else mtp_layout
  if layout and layout != found:
    _fail("mtp_layout", mtp_layout, f"the checkpoint holds {found or 'no MTP layers'}")
  mtp_names = hf_mtp.shipped(found, hf, tensors)
  trunk = W.trunk_params_from_hf({k: v for k, v in tensors.items() if k not in mtp_names},
                                 mcfg, hf_dir)
  if layout == "medusa":
    heads_cfg, heads = hf_mtp.medusa_heads(medusa_file, mcfg)
    note = f"Medusa heads (K={heads_cfg.num}, {heads_cfg.layers} layers each) from {medusa_file}"
  elif layout:
    heads_cfg, heads = hf_mtp.sequential_heads(layout, hf, tensors, mcfg, hf_dir, mtp_carry)
    note = (f"{layout} MTP layers (K={heads_cfg.num}, carry={heads_cfg.carry}"
            + (", module 1 drafts every position" if heads_cfg.num == 1 else "") + ")")
  else:
    heads, note = _native_heads(hf_dir, mcfg, heads_cfg, seed)
    if found:
      note += f" ({found} MTP layers left out: --mtp_layout=none)"
  heads = _conform_heads(mcfg, heads_cfg, heads, hf_dir)
  cfg = Config(model=mcfg, heads=heads_cfg,
               data=config_lib.DataConfig(seq_len=min(128, mcfg.max_seq_len - heads_cfg.num)))
  ckpt_lib.save_model_dir(out_dir, cfg, {"trunk": trunk, "heads": heads}, tok,
                          dtype=mcfg.param_dtype, hf_config=hf, mtp_layout=layout)
  return mcfg, note


def _tokenizer(hf_dir: str, hf: dict, eod_token: str) -> Tokenizer:
  tok_path = os.path.join(hf_dir, "tokenizer.json")
  if not os.path.exists(tok_path):
    raise HFImportError(f"{hf_dir}: missing tokenizer.json (the fast-tokenizer file; "
                        "transformers writes it with tokenizer.save_pretrained)")
  try:
    from tokenizers import Tokenizer as HFTokenizer
    raw = HFTokenizer.from_file(tok_path)
    template, chat_tokens = chat.read_hf(hf_dir)
    eod, stops = _end_tokens(hf_dir, hf, raw, eod_token, chat_tokens)
    return Tokenizer(raw, tok_path, eod_token=eod, stop_tokens=stops, chat_tokens=chat_tokens,
                     chat_template=template)
  except (ValueError, chat.ChatError) as e:
    raise HFImportError(str(e)) from None
  except Exception as e:  # tokenizers raises a bare Exception on bad JSON
    raise HFImportError(f"{tok_path}: not a valid tokenizer.json ({e})") from None


def _native_heads(hf_dir: str, mcfg: ModelConfig, heads_cfg: HeadsConfig, seed: int):
  """mtp-jax's own heads: the directory's `mtp_heads.safetensors` (an export) when it matches
  heads_cfg, else fresh ones."""
  heads, note = _fresh_heads(mcfg, heads_cfg, seed), f"fresh {heads_cfg.kind} heads (K={heads_cfg.num})"
  heads_path = os.path.join(hf_dir, HEADS_FILE)
  if os.path.exists(heads_path):
    saved_cfg, saved = read_heads(heads_path)
    if saved_cfg == heads_cfg:
      heads, note = saved, f"{heads_cfg.kind} heads (K={heads_cfg.num}) from {HEADS_FILE}"
    else:
      note += f" ({HEADS_FILE} holds {saved_cfg}, not used)"
  return heads, note


def _fresh_heads(mcfg: ModelConfig, heads_cfg: HeadsConfig, seed: int):
  from flax import nnx

  from mtp_jax.models import heads as heads_lib
  module = heads_lib.make_heads(mcfg, heads_cfg, nnx.Rngs(params=seed))
  return nnx.to_pure_dict(nnx.split(module)[1])


def _conform_heads(mcfg: ModelConfig, heads_cfg: HeadsConfig, heads, where: str):
  """The heads params with the keys, shapes and dtypes heads_cfg implies (or the error naming
  what does not match)."""
  import jax
  _, abstract = model_lib.abstract(mcfg, heads_cfg)
  flat_f = dict(ckpt_lib._flat(abstract["heads"]))
  flat_h = dict(ckpt_lib._flat(heads))
  if set(flat_f) != set(flat_h) or any(
      tuple(flat_f[k].shape) != tuple(np.shape(flat_h[k])) for k in flat_f):
    raise HFImportError(f"{where}: heads do not match their config (expected "
                        f"{ {k: tuple(v.shape) for k, v in flat_f.items()} })")
  return jax.tree.map(lambda f, h: np.asarray(h).astype(f.dtype), abstract["heads"],
                      ckpt_lib._conform(abstract["heads"], heads))


# ----------------------------------------------------------------------------- export


def read_heads(path: str):
  """-> (HeadsConfig, heads params) from an exported `mtp_heads.safetensors`."""
  from safetensors import safe_open
  with safe_open(path, framework="numpy") as f:
    meta = f.metadata() or {}
    if "heads" not in meta:
      raise HFImportError(f"{path}: no 'heads' metadata (not written by mtp-jax export)")
    hcfg = config_lib._build(HeadsConfig, "heads", json.loads(meta["heads"]))
    tree: dict = {}
    for key in f.keys():
      parts = key.split(".")[1:]
      node = tree
      for p in parts[:-1]:
        node = node.setdefault(p, {})
      node[parts[-1]] = f.get_tensor(key)
  return hcfg, tree


def export_model(model_dir: str, out_dir: str) -> list[str]:
  """Writes `model.safetensors` + `config.json` + `tokenizer.json` (HF names) and the heads into
  out_dir: where they were imported from a published layout, back to it (hf_mtp.py: MTP modules
  in model.safetensors, Medusa heads in `medusa_lm_head.safetensors`); else as
  `mtp_heads.safetensors`. -> the files written."""
  from safetensors.numpy import save_file
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(model_dir)
  meta = ckpt_lib.read_meta(model_dir)
  layout = meta.get("mtp_layout", "")
  hf = hf_config_for(mcfg, tok, meta.get("hf_config"))
  trunk = {k: np.asarray(v) for k, v in ckpt_lib._flat(params["trunk"])}
  heads = {k: np.asarray(v) for k, v in ckpt_lib._flat(params["heads"])}
  tensors = {}
  for name, path, kind in W.trunk_names(mcfg, with_lm_head=not mcfg.tie_embeddings):
    tensors[name] = np.ascontiguousarray(W.to_hf(trunk["/".join(map(str, path))], kind))
  if mcfg.tie_embeddings and not hf.get("tie_word_embeddings", False):
    scale = mcfg.d_model ** -0.5 if mcfg.tied_logits_scale else 1.0
    emb = trunk["embed_VD"]
    tensors["lm_head.weight"] = (emb.astype(np.float32) * scale).astype(emb.dtype)
  if layout in ("mimo", "deepseek"):
    tensors.update(hf_mtp.export_sequential(layout, hcfg, heads, mcfg, tensors))
    hf["num_nextn_predict_layers"] = hcfg.num
  elif layout == "medusa":
    hf.update(medusa_num_heads=hcfg.num, medusa_num_layers=hcfg.layers)
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  shutil.copy(os.path.join(model_dir, "tokenizer.json"), os.path.join(out_dir, "tokenizer.json"))
  files = ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"]
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(chat.hf_tokenizer_config(tok.chat_template, tok.chat_tokens, tok.eod_token,
                                       tok.pad_token), f, indent=2, ensure_ascii=False)
  if tok.stop_tokens:           # every token that ends a generation, as transformers reads them
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
      json.dump({"eos_token_id": list(tok.end_ids)}, f, indent=2)
    files.append("generation_config.json")
  if layout == "medusa":
    save_file(hf_mtp.export_medusa(hcfg, heads), os.path.join(out_dir, hf_mtp.MEDUSA_FILE),
              metadata={"format": "pt"})
    files.append(hf_mtp.MEDUSA_FILE)
  elif not layout:
    save_file({"heads." + k.replace("/", "."): np.ascontiguousarray(v) for k, v in heads.items()},
              os.path.join(out_dir, HEADS_FILE),
              metadata={"format": "mtp-jax", "heads": json.dumps(dataclasses.asdict(hcfg))})
    files.append(HEADS_FILE)
  return files
