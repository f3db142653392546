"""HF tensor names <-> mtp-jax parameters: the trunk's and one decoder layer's names, the
[out, in] <-> [in, ...] conversions, reading safetensors (numpy, never pickle) and filling a
params tree with shape checks. Used by hf.py (the trunk) and hf_mtp.py (shipped MTP layers)."""

from __future__ import annotations

import json
import os

import numpy as np

from mtp_jax.config import HeadsConfig, ModelConfig
from mtp_jax.formats.hf_config import HFImportError
from mtp_jax.models import model as model_lib


def trunk_names(mcfg: ModelConfig, with_lm_head: bool):
  """(HF name, path in the trunk params, kind) for every trunk tensor."""
  out = [("model.embed_tokens.weight", ("embed_VD",), "same"),
         ("model.norm.weight", ("final_norm", "scale"), "same")]
  if with_lm_head:
    out.append(("lm_head.weight", ("unembed_DV",), "T"))
  for i in range(mcfg.n_layers):
    out += layer_names(mcfg, f"model.layers.{i}.", ("blocks", i))
  return out


def layer_names(mcfg: ModelConfig, p: str, b: tuple):
  """(HF name, params path, kind) of one decoder layer named from prefix p, at params path b."""
  out = [(p + "input_layernorm.weight", b + ("attn_norm", "scale"), "same"),
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


def from_hf(x: np.ndarray, kind: str, shape: tuple) -> np.ndarray:
  """HF [out, in] matrices are transposed (and split into heads: 'in' [N*H, D] -> [D, N, H],
  'out' [D, N*H] -> [N, H, D]); vectors keep their values."""
  return (x.T if kind in ("T", "in", "out") else x).reshape(shape)


def to_hf(x: np.ndarray, kind: str) -> np.ndarray:
  if kind == "in":
    return x.reshape(x.shape[0], -1).T
  if kind == "out":
    return x.reshape(-1, x.shape[-1]).T
  if kind == "T":
    return x.T
  if kind == "flat":
    return x.reshape(-1)
  return x


def get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def put(tree, path, value):
  for k in path[:-1]:
    tree = tree[k]
  tree[path[-1]] = value


def read_file(path: str) -> dict[str, np.ndarray]:
  """Every tensor of one safetensors file (numpy)."""
  from safetensors import safe_open
  try:
    with safe_open(path, framework="numpy") as f:
      return {key: f.get_tensor(key) for key in f.keys()}
  except Exception as e:  # safetensors raises its own error types on a bad header
    raise HFImportError(f"{path}: not a readable safetensors file ({e})") from None


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
  names = trunk_names(mcfg, with_lm_head=not mcfg.tie_embeddings)
  expected = {n for n, _, _ in names}
  ignorable = {"lm_head.weight"} if mcfg.tie_embeddings else set()
  extra = sorted(k for k in tensors
                 if k not in expected and k not in ignorable and not k.endswith("rotary_emb.inv_freq"))
  missing = sorted(expected - set(tensors))
  if missing or extra:
    raise HFImportError(f"{hf_dir}: weights do not match config.json (missing: {missing[:5]}, "
                        f"unexpected: {extra[:5]})")
  return fill(abstract["trunk"], names, tensors, mcfg.param_dtype, hf_dir)


def fill(abstract, names, tensors: dict[str, np.ndarray], dtype: str, where: str,
         tree=None):
  """Params shaped as `abstract` (ShapeDtypeStructs) from HF-named tensors along `names`
  ((HF name, params path, kind)); a missing or misshapen tensor is named in the error."""
  tree = _empty_like(abstract) if tree is None else tree
  np_dtype = np.dtype(np_dtype_of(dtype))
  for name, path, kind in names:
    if name not in tensors:
      raise HFImportError(f"{where}: missing tensor {name}")
    want = tuple(get(abstract, path).shape)
    x = tensors[name]
    n_want = int(np.prod(want))
    if x.size != n_want or (kind == "T" and tuple(x.shape[::-1]) != want):
      raise HFImportError(f"{where}: tensor {name} has shape {tuple(x.shape)}, config.json "
                          f"implies {want} for {'/'.join(map(str, path))}")
    put(tree, path, np.ascontiguousarray(from_hf(x, kind, want)).astype(np_dtype))
  return tree


def np_dtype_of(name: str):
  if name == "bfloat16":
    import ml_dtypes
    return ml_dtypes.bfloat16
  return name


def _empty_like(tree):
  if isinstance(tree, dict):
    return {k: _empty_like(v) for k, v in tree.items()}
  return None
