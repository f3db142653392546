"""Llama-family checkpoints of HF transformers: import into a model directory, export back.

Supported architectures: `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, as saved
by `save_pretrained(safe_serialization=True)`: `config.json`, `model.safetensors` or a sharded
`model.safetensors.index.json`, and `tokenizer.json`. Weights are read with `safetensors`
(numpy), never with pickle.

What maps onto the trunk: RoPE theta and the rope kinds `default`, `linear`, `llama3`, `yarn`
(and `dynamic`, which equals `default` up to max_position_embeddings, the import's limit), GQA,
an explicit `head_dim`, tied or untied embeddings, attention biases (Llama's `attention_bias`,
Qwen2's q/k/v biases). A sliding window is exact when no sequence is longer than the window, so
the imported model's `max_seq_len` is capped at it. Anything else the trunk lacks (an unknown
architecture, MoE, another rope kind, partial rotary, another activation, MLP biases) fails with
an `HFImportError` naming the config field and its value.

Export writes the trunk back under HF names (`model.safetensors`, `config.json`,
`tokenizer.json`; loadable by transformers) and the heads to `mtp_heads.safetensors`, which an
import of that directory picks up again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import config as config_lib
from mtp_jax import model as model_lib
from mtp_jax.config import Config, HeadsConfig, ModelConfig
from mtp_jax.tokenizer import Tokenizer

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ROPE_KINDS = ("default", "linear", "llama3", "yarn", "dynamic")
HEADS_FILE = "mtp_heads.safetensors"
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class HFImportError(ValueError):
  """A HF checkpoint that cannot be imported; the message names the field and its value."""


def _fail(field: str, value, why: str):
  raise HFImportError(f"{field}={value!r}: {why}")


# ----------------------------------------------------------------------------- config


def read_hf_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, "config.json")
  if not os.path.isdir(hf_dir):
    raise HFImportError(f"HF model directory not found: {hf_dir}")
  if not os.path.exists(path):
    raise HFImportError(f"{hf_dir}: missing config.json (a HF model directory holds config.json, "
                        "model.safetensors or model.safetensors.index.json, tokenizer.json)")
  try:
    with open(path) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise HFImportError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(hf, dict):
    raise HFImportError(f"{path}: must be a JSON object")
  return hf


def _rope(hf: dict) -> dict:
  """The rope parameters in one form: transformers 5 `rope_parameters` (with rope_theta inside)
  or transformers 4 `rope_theta` + `rope_scaling` (`type` or `rope_type`)."""
  if isinstance(hf.get("rope_parameters"), dict):
    rp, field = dict(hf["rope_parameters"]), "rope_parameters"
  else:
    rp, field = dict(hf.get("rope_scaling") or {}), "rope_scaling"
    rp.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  if "rope_type" not in rp:
    rp["rope_type"] = rp.pop("type", "default")
  if "sliding_attention" in rp or "full_attention" in rp:
    _fail(field, sorted(rp), "per-layer rope parameters are not supported")
  rp["_field"] = field
  return rp


def model_config_from_hf(hf: dict, max_seq_len: int = 0, param_dtype: str = "") -> ModelConfig:
  """The trunk's config for a HF config, or an HFImportError naming what does not fit."""
  archs = hf.get("architectures") or []
  if len(archs) != 1 or archs[0] not in ARCHITECTURES:
    _fail("architectures", archs, f"must be one of {list(ARCHITECTURES)}")
  arch = archs[0]
  for field in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
    if hf.get(field):
      _fail(field, hf[field], "mixture-of-experts layers are not supported")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    _fail("hidden_act", act, "only 'silu' (SwiGLU MLP) is supported")
  if hf.get("mlp_bias"):
    _fail("mlp_bias", hf["mlp_bias"], "MLP biases are not supported")
  for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size", "max_position_embeddings"):
    if not isinstance(hf.get(field), int) or hf[field] < 1:
      _fail(field, hf.get(field), "must be a positive integer")

  rp = _rope(hf)
  kind, field = rp["rope_type"], rp["_field"]
  if kind not in ROPE_KINDS:
    _fail(f"{field}.rope_type", kind, f"must be one of {list(ROPE_KINDS)}")
  partial = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  if partial not in (None, 1, 1.0):
    _fail("partial_rotary_factor", partial, "partial rotary embeddings are not supported")
  rope = {"rope_theta": float(rp.get("rope_theta", 10000.0))}
  if kind in ("linear", "llama3", "yarn"):
    rope["rope_scaling"] = kind
    factor = rp.get("factor")
    if kind == "yarn" and factor is None:
      factor = hf["max_position_embeddings"] / rp["original_max_position_embeddings"]
    rope["rope_factor"] = float(factor)
  if kind == "llama3":
    rope.update(rope_low_freq_factor=float(rp["low_freq_factor"]),
                rope_high_freq_factor=float(rp["high_freq_factor"]),
                rope_original_max_len=int(rp["original_max_position_embeddings"]))
  if kind == "yarn":
    rope.update(rope_original_max_len=int(rp["original_max_position_embeddings"]),
                rope_beta_fast=float(rp.get("beta_fast") or 32.0),
                rope_beta_slow=float(rp.get("beta_slow") or 1.0),
                rope_truncate=bool(rp.get("truncate", True)),
                rope_attention_factor=_yarn_attention_factor(rp, rope["rope_factor"]))

  limit, why = hf["max_position_embeddings"], "max_position_embeddings"
  window = _sliding_window(hf, arch)
  if window is not None and window < limit:
    limit, why = window, f"sliding_window={window} (attention is exact up to the window)"
  if max_seq_len > limit:
    _fail("max_seq_len", max_seq_len, f"must be <= {limit}, the checkpoint's {why}")

  if arch == "Qwen2ForCausalLM":
    qkv_bias, out_bias = True, False
  else:
    qkv_bias = out_bias = bool(hf.get("attention_bias", False))
  n_heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
  dtype = param_dtype or _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"))
  if dtype not in config_lib.DTYPES:
    _fail("dtype", hf.get("dtype") or hf.get("torch_dtype"),
          f"must be one of {config_lib.DTYPES} (or pass --param_dtype)")
  try:
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads, d_ff=hf["intermediate_size"],
        max_seq_len=max_seq_len or limit, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), tied_logits_scale=False,
        head_size=head_dim if head_dim * n_heads != hf["hidden_size"] else 0,
        qkv_bias=qkv_bias, out_bias=out_bias, param_dtype=dtype, **rope)
  except config_lib.ConfigError as e:
    msg = str(e)
    for ours, theirs in _HF_FIELD.items():
      msg = msg.replace(f"model.{ours}=", f"{theirs}=")
    raise HFImportError(f"config.json does not fit the trunk: {msg}") from None


_HF_FIELD = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
             "d_ff": "intermediate_size", "head_size": "head_dim", "norm_eps": "rms_norm_eps",
             "rope_theta": "rope_theta", "rope_factor": "rope factor",
             "rope_original_max_len": "original_max_position_embeddings",
             "rope_low_freq_factor": "low_freq_factor", "max_seq_len": "max_position_embeddings"}


def _yarn_attention_factor(rp: dict, factor: float) -> float:
  import math
  if rp.get("attention_factor") is not None:
    return float(rp["attention_factor"])

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
  if rp.get("mscale") and rp.get("mscale_all_dim"):
    return float(mscale(factor, rp["mscale"]) / mscale(factor, rp["mscale_all_dim"]))
  return float(mscale(factor))


def _sliding_window(hf: dict, arch: str) -> int | None:
  if arch == "LlamaForCausalLM":
    return None
  window = hf.get("sliding_window")
  if arch == "Qwen2ForCausalLM":
    sliding_layers = "sliding_attention" in (hf.get("layer_types") or [])
    if not (hf.get("use_sliding_window") or sliding_layers):
      return None
  if window is not None and (not isinstance(window, int) or window < 1):
    _fail("sliding_window", window, "must be null or a positive integer")
  return window


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


def _eod_token(hf_dir: str, hf: dict, raw, override: str) -> str:
  if override:
    return override
  eos, source = hf.get("eos_token_id"), "config.json"
  gen = os.path.join(hf_dir, "generation_config.json")
  if eos is None and os.path.exists(gen):
    with open(gen) as f:
      eos, source = json.load(f).get("eos_token_id"), "generation_config.json"
  if isinstance(eos, list):
    eos = eos[0] if eos else None
  token = raw.id_to_token(eos) if isinstance(eos, int) else None
  if token is None:
    raise HFImportError(f"{source}: eos_token_id={eos!r} names no token of tokenizer.json; "
                        "pass --eod_token=TOKEN")
  return token


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
    tok = Tokenizer(raw, tok_path, eod_token=_eod_token(hf_dir, hf, raw, eod_token))
  except ValueError as e:
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
  from mtp_jax import heads as heads_lib
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


def hf_config_for(mcfg: ModelConfig, tok: Tokenizer, hf_config: dict | None) -> dict:
  """The HF config.json of an exported trunk: the imported one when there is one, else a
  LlamaForCausalLM config written from the trunk's."""
  if hf_config:
    out = dict(hf_config)
    key = "dtype" if "dtype" in out or "torch_dtype" not in out else "torch_dtype"
    out[key] = mcfg.param_dtype
    return out
  if mcfg.qkv_bias != mcfg.out_bias:
    _fail("model.qkv_bias", mcfg.qkv_bias, "Llama has one attention_bias for q, k, v and o")
  rope: dict = {"rope_theta": mcfg.rope_theta, "rope_type": "default"}
  if mcfg.rope_scaling == "linear":
    rope.update(rope_type="linear", factor=mcfg.rope_factor)
  elif mcfg.rope_scaling == "llama3":
    rope.update(rope_type="llama3", factor=mcfg.rope_factor,
                low_freq_factor=mcfg.rope_low_freq_factor,
                high_freq_factor=mcfg.rope_high_freq_factor,
                original_max_position_embeddings=mcfg.rope_original_max_len)
  elif mcfg.rope_scaling == "yarn":
    rope.update(rope_type="yarn", factor=mcfg.rope_factor,
                original_max_position_embeddings=mcfg.rope_original_max_len,
                beta_fast=mcfg.rope_beta_fast, beta_slow=mcfg.rope_beta_slow,
                attention_factor=mcfg.rope_attention_factor, truncate=mcfg.rope_truncate)
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": mcfg.vocab_size, "hidden_size": mcfg.d_model,
      "intermediate_size": mcfg.d_ff, "num_hidden_layers": mcfg.n_layers,
      "num_attention_heads": mcfg.n_heads, "num_key_value_heads": mcfg.n_kv_heads,
      "head_dim": mcfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": mcfg.max_seq_len, "rms_norm_eps": mcfg.norm_eps,
      "rope_theta": mcfg.rope_theta, "rope_parameters": rope,
      # A native tied model scales its logits: exported untied with the scale folded in.
      "tie_word_embeddings": mcfg.tie_embeddings and not mcfg.tied_logits_scale,
      "attention_bias": mcfg.qkv_bias, "mlp_bias": False,
      "bos_token_id": None, "eos_token_id": tok.eod_id, "pad_token_id": tok.pad_id,
      "dtype": mcfg.param_dtype,
  }


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
  heads = {"heads." + k.replace("/", "."): np.ascontiguousarray(np.asarray(v))
           for k, v in ckpt_lib._flat(params["heads"])}
  save_file(heads, os.path.join(out_dir, HEADS_FILE),
            metadata={"format": "mtp-jax", "heads": json.dumps(dataclasses.asdict(hcfg))})
  return ["model.safetensors", "config.json", "tokenizer.json", HEADS_FILE]
