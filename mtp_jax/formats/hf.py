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


# ----------------------------------------------------------------------------- weights


def _names(mcfg: ModelConfig, with_lm_head: bool):
  """(HF name, path in the trunk params, kind) for every trunk tensor."""
  out = [("model.embed_tokens.weight", ("embed_VD",), "same"),
         ("model.norm.weight", ("final_norm", "scale"), "same")]
  if with_lm_head:
    out.append(("lm_head.weight", ("unembed_DV",), "T"))
  for i in range(mcfg.n_layers):
    p, b = f"model.layers.{i}.", ("blocks", i)
    out += [(p + "input_layernorm.weight", b + ("attn_norm", "scale"), "same"),
            (p + "post_attention_layernorm.weight", b + ("mlp_norm", "scale"), "same"),
            (p + "self_attn.q_proj.weight", b + ("attn", "wq_DNH"), "in"),
            (p + "self_attn.k_proj.weight", b + ("attn", "wk_DGH"), "in"),
            (p + "self_attn.v_proj.weight", b + ("attn", "wv_DGH"), "in"),
            (p + "self_attn.o_proj.weight", b + ("attn", "wo_NHD"), "out"),
            (p + "mlp.gate_proj.weight", b + ("mlp", "gate_DF"), "T"),
            (p + "mlp.up_proj.weight", b + ("mlp", "up_DF"), "T"),
            (p + "mlp.down_proj.weight", b + ("mlp", "down_FD"), "T")]
    if mcfg.qkv_bias:
      out += [(p + "self_attn.q_proj.bias", b + ("attn", "bq_NH"), "flat"),
              (p + "self_attn.k_proj.bias", b + ("attn", "bk_GH"), "flat"),
              (p + "self_attn.v_proj.bias", b + ("attn", "bv_GH"), "flat")]
    if mcfg.out_bias:
      out.append((p + "self_attn.o_proj.bias", b + ("attn", "bo_D"), "same"))
  return out


def _from_hf(x: np.ndarray, kind: str, shape: tuple) -> np.ndarray:
  """HF [out, in] matrices are transposed (and split into heads: 'in' [N*H, D] -> [D, N, H],
  'out' [D, N*H] -> [N, H, D]); vectors keep their values."""
  return (x.T if kind in ("T", "in", "out") else x).reshape(shape)


def _to_hf(x: np.ndarray, kind: str) -> np.ndarray:
  if kind == "in":
    return x.reshape(x.shape[0], -1).T
  if kind == "out":
    return x.reshape(-1, x.shape[-1]).T
  if kind == "T":
    return x.T
  if kind == "flat":
    return x.reshape(-1)
  return x


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  for k in path[:-1]:
    tree = tree[k]
  tree[path[-1]] = value


def read_safetensors(hf_dir: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  single = os.path.join(hf_dir, "model.safetensors")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  elif os.path.exists(single):
    files = ["model.safetensors"]
  else:
    bins = [n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth"))]
    raise HFImportError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json"
                        + (f" (found {bins}: pickle files are not read; convert them to "
                           "safetensors)" if bins else ""))
  tensors = {}
  for name in files:
    path = os.path.join(hf_dir, name)
    if not os.path.exists(path):
      raise HFImportError(f"{index}: names shard {name}, which is missing")
    with safe_open(path, framework="numpy") as f:
      for key in f.keys():
        tensors[key] = f.get_tensor(key)
  return tensors


def trunk_params_from_hf(tensors: dict[str, np.ndarray], mcfg: ModelConfig, hf_dir: str = ""):
  """The trunk's params (numpy, mcfg.param_dtype) from HF-named tensors; missing, unexpected or
  misshapen tensors are named in the error."""
  _, abstract = model_lib.abstract(mcfg, HeadsConfig(num=1))
  trunk = _empty_like(abstract["trunk"])
  names = _names(mcfg, with_lm_head=not mcfg.tie_embeddings)
  expected = {n for n, _, _ in names}
  ignorable = {"lm_head.weight"} if mcfg.tie_embeddings else set()
  extra = sorted(k for k in tensors
                 if k not in expected and k not in ignorable and not k.endswith("rotary_emb.inv_freq"))
  missing = sorted(expected - set(tensors))
  if missing or extra:
    raise HFImportError(f"{hf_dir}: weights do not match config.json (missing: {missing[:5]}, "
                        f"unexpected: {extra[:5]})")
  dtype = np.dtype(_np_dtype(mcfg.param_dtype))
  for name, path, kind in names:
    want = tuple(_get(abstract["trunk"], path).shape)
    x = tensors[name]
    n_want = int(np.prod(want))
    if x.size != n_want or (kind == "T" and tuple(x.shape[::-1]) != want):
      raise HFImportError(f"{hf_dir}: tensor {name} has shape {tuple(x.shape)}, config.json "
                          f"implies {want} for {'/'.join(map(str, path))}")
    _set(trunk, path, np.ascontiguousarray(_from_hf(x, kind, want)).astype(dtype))
  return trunk


def _np_dtype(name: str):
  if name == "bfloat16":
    import ml_dtypes
    return ml_dtypes.bfloat16
  return name


def _empty_like(tree):
  if isinstance(tree, dict):
    return {k: _empty_like(v) for k, v in tree.items()}
  return None


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
                 param_dtype: str = "", eod_token: str = "", seed: int = 0) -> tuple[ModelConfig, str]:
  """Writes an mtp-jax model directory with the HF trunk and heads of `heads_cfg` (fresh, or
  the directory's own `mtp_heads.safetensors` when it matches). -> (ModelConfig, what happened)."""
  hf = read_hf_config(hf_dir)
  mcfg = model_config_from_hf(hf, max_seq_len, param_dtype)
  tok_path = os.path.join(hf_dir, "tokenizer.json")
  if not os.path.exists(tok_path):
    raise HFImportError(f"{hf_dir}: missing tokenizer.json (the fast-tokenizer file; "
                        "transformers writes it with tokenizer.save_pretrained)")
  try:
    from tokenizers import Tokenizer as HFTokenizer
    raw = HFTokenizer.from_file(tok_path)
    template, chat_tokens = chat.read_hf(hf_dir)
    eod, stops = _end_tokens(hf_dir, hf, raw, eod_token, chat_tokens)
    tok = Tokenizer(raw, tok_path, eod_token=eod, stop_tokens=stops, chat_tokens=chat_tokens,
                    chat_template=template)
  except (ValueError, chat.ChatError) as e:
    raise HFImportError(str(e)) from None
  except Exception as e:  # tokenizers raises a bare Exception on bad JSON
    raise HFImportError(f"{tok_path}: not a valid tokenizer.json ({e})") from None
  if tok.vocab_size > mcfg.vocab_size:
    _fail("vocab_size", mcfg.vocab_size, f"is smaller than tokenizer.json's {tok.vocab_size}")
  trunk = trunk_params_from_hf(read_safetensors(hf_dir), mcfg, hf_dir)
  fresh = _fresh_heads(mcfg, heads_cfg, seed)
  heads, note = fresh, f"fresh {heads_cfg.kind} heads (K={heads_cfg.num})"
  heads_path = os.path.join(hf_dir, HEADS_FILE)
  if os.path.exists(heads_path):
    saved_cfg, saved = read_heads(heads_path)
    if saved_cfg == heads_cfg:
      heads, note = saved, f"{heads_cfg.kind} heads (K={heads_cfg.num}) from {HEADS_FILE}"
    else:
      note += f" ({HEADS_FILE} holds {saved_cfg}, not used)"
  heads = _conform_heads(fresh, heads, heads_path)
  cfg = Config(model=mcfg, heads=heads_cfg,
               data=config_lib.DataConfig(seq_len=min(128, mcfg.max_seq_len - heads_cfg.num)))
  ckpt_lib.save_model_dir(out_dir, cfg, {"trunk": trunk, "heads": heads}, tok,
                          dtype=mcfg.param_dtype, hf_config=hf)
  return mcfg, note


def _fresh_heads(mcfg: ModelConfig, heads_cfg: HeadsConfig, seed: int):
  from flax import nnx

  from mtp_jax.models import heads as heads_lib
  module = heads_lib.make_heads(mcfg, heads_cfg, nnx.Rngs(params=seed))
  return nnx.to_pure_dict(nnx.split(module)[1])


def _conform_heads(fresh, heads, where):
  import jax
  flat_f = dict(ckpt_lib._flat(fresh))
  flat_h = dict(ckpt_lib._flat(heads))
  if set(flat_f) != set(flat_h) or any(
      tuple(np.shape(flat_f[k])) != tuple(np.shape(flat_h[k])) for k in flat_f):
    raise HFImportError(f"{where}: heads do not match their config (expected "
                        f"{ {k: tuple(np.shape(v)) for k, v in flat_f.items()} })")
  return jax.tree.map(lambda f, h: np.asarray(h).astype(np.asarray(f).dtype), fresh,
                      ckpt_lib._conform(fresh, heads))


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
  """Writes `model.safetensors` + `config.json` + `tokenizer.json` (HF names) and the heads as
  `mtp_heads.safetensors` into out_dir. -> the files written."""
  from safetensors.numpy import save_file
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(model_dir)
  meta = ckpt_lib.read_meta(model_dir)
  hf = hf_config_for(mcfg, tok, meta.get("hf_config"))
  trunk = {k: np.asarray(v) for k, v in ckpt_lib._flat(params["trunk"])}
  tied_hf = bool(hf.get("tie_word_embeddings", False))
  tensors = {}
  for name, path, kind in _names(mcfg, with_lm_head=not mcfg.tie_embeddings):
    tensors[name] = np.ascontiguousarray(_to_hf(trunk["/".join(map(str, path))], kind))
  if mcfg.tie_embeddings and not tied_hf:
    scale = mcfg.d_model ** -0.5 if mcfg.tied_logits_scale else 1.0
    emb = trunk["embed_VD"]
    tensors["lm_head.weight"] = (emb.astype(np.float32) * scale).astype(emb.dtype)
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
  heads = {"heads." + k.replace("/", "."): np.ascontiguousarray(np.asarray(v))
           for k, v in ckpt_lib._flat(params["heads"])}
  save_file(heads, os.path.join(out_dir, HEADS_FILE),
            metadata={"format": "mtp-jax", "heads": json.dumps(dataclasses.asdict(hcfg))})
  return files + [HEADS_FILE]
