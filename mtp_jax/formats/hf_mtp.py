"""Multi-token-prediction layers that ship with HF checkpoints, imported onto mtp-jax's heads and
exported back to where they came from (docs/models.md has the table).

  mimo      Xiaomi MiMo: `model.mtp_layers.{i}.` token_layernorm, hidden_layernorm, input_proj
            over cat[hidden, embedding], a Qwen2 decoder layer, final_layernorm; module 1 reads
            the trunk's state before its final norm, the normed output is both the next draft's
            input and the logits' (sequential heads, carry='normed', trunk_state='pre_norm').
  deepseek  DeepSeek-V3 / GLM-4.5: `model.layers.{L+i}.` enorm, hnorm, eh_proj over
            cat[embedding, hidden], a decoder layer, shared_head.norm (shared_head.head and
            embed_tokens are the trunk's, stored again); the raw output goes on to the next
            module (carry='raw'; GLM's normed output: --mtp_carry=normed). Dense trunks and
            modules only: MoE and MLA configs are refused (hf_config.py).
  medusa    Medusa-1: `medusa_lm_head.safetensors`, per head i the residual SiLU blocks
            `{i}.{j}.linear.weight / .bias` and its own lm_head `{i}.{L}.weight` (parallel heads,
            own_unembed).

Both sequential layouts give module 1 a zero embedding at trunk position 0, as vLLM runs them.
Where a checkpoint has fewer modules than the drafts asked, module 1 drafts them all
(decode.reuse_module, automatic with one module).
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from mtp_jax.config import HeadsConfig, ModelConfig
from mtp_jax.formats import hf_weights as W
from mtp_jax.formats.hf_config import HFImportError
from mtp_jax.models import model as model_lib

LAYOUTS = ("auto", "none", "mimo", "deepseek", "medusa")
MEDUSA_FILE = "medusa_lm_head.safetensors"
_NORMS = {"mimo": ("token_layernorm", "hidden_layernorm", "final_layernorm", "input_proj"),
          "deepseek": ("enorm", "hnorm", "shared_head.norm", "eh_proj")}


def medusa_path(hf_dir: str, medusa: str) -> str:
  """The Medusa heads file: `medusa` (a file, or a directory holding MEDUSA_FILE), else the HF
  directory's own MEDUSA_FILE; '' when there is none."""
  path = medusa or hf_dir
  if os.path.isdir(path):
    found = os.path.join(path, MEDUSA_FILE)
    if os.path.exists(found):
      return found
    if medusa:
      pt = [n for n in os.listdir(path) if n.startswith("medusa_lm_head")]
      raise HFImportError(f"--medusa={medusa}: no {MEDUSA_FILE}" + (
          f" (found {pt}: pickle files are not read; convert them to safetensors)" if pt else ""))
    return ""
  if medusa and not os.path.exists(path):
    raise HFImportError(f"--medusa={medusa}: no such file or directory")
  return path


def detect(hf: dict, tensors: dict, medusa_file: str) -> str:
  """The layout of the MTP layers a checkpoint ships ('' for none)."""
  if any(k.startswith("model.mtp_layers.") for k in tensors):
    return "mimo"
  if any(k.startswith(f"model.layers.{hf.get('num_hidden_layers')}.") for k in tensors):
    return "deepseek"
  return "medusa" if medusa_file else ""


def shipped(layout: str, hf: dict, tensors: dict) -> set[str]:
  """The names of the trunk file's tensors that belong to the MTP layers."""
  if layout == "mimo":
    return {k for k in tensors if k.startswith("model.mtp_layers.")}
  if layout == "deepseek":
    n = hf.get("num_hidden_layers")
    return {k for k in tensors if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m[1]) >= n}
  return set()


def _prefix(layout: str, n_trunk: int, i: int) -> str:
  """The HF name prefix of module i (0-based) after a trunk of n_trunk layers."""
  return f"model.mtp_layers.{i}." if layout == "mimo" else f"model.layers.{n_trunk + i}."


def _module_names(layout: str, mcfg: ModelConfig, n_trunk: int, i: int):
  """(HF names, params path, kind) of sequential module i, and its input projection's name."""
  p = _prefix(layout, n_trunk, i)
  e, h, out, proj = _NORMS[layout]
  b = ("modules", i)
  names = [(p + e + ".weight", b + ("e_norm", "scale"), "same"),
           (p + h + ".weight", b + ("h_norm", "scale"), "same"),
           (p + out + ".weight", b + ("out_norm", "scale"), "same")]
  return names + W.layer_names(mcfg, p, b + ("block",)), p + proj + ".weight"


def _count_modules(layout: str, hf: dict, names: set[str]) -> int:
  found = len({int(k.split(".")[2]) for k in names})      # model.{mtp_layers,layers}.{i}.
  declared = hf.get("num_nextn_predict_layers")
  if declared is not None and declared != found:
    raise HFImportError(f"num_nextn_predict_layers={declared!r}: the weights hold {found} MTP "
                        "layers")
  return found


def sequential_heads(layout: str, hf: dict, tensors: dict, mcfg: ModelConfig, where: str,
                     carry: str = ""):
  """-> (HeadsConfig, heads params) of the checkpoint's MTP modules (mimo or deepseek)."""
  names_in = shipped(layout, hf, tensors)
  n = _count_modules(layout, hf, names_in)
  gate_name = _prefix(layout, mcfg.n_layers, 0) + "mlp.gate_proj.weight"
  d_ff = tensors[gate_name].shape[0] if gate_name in tensors else mcfg.d_ff
  hcfg = HeadsConfig(kind="sequential", num=n, module_d_ff=0 if d_ff == mcfg.d_ff else d_ff,
                     carry=carry or ("normed" if layout == "mimo" else "raw"),
                     trunk_state="pre_norm" if layout == "mimo" else "normed",
                     zero_first_embed=True)
  _, abstract = model_lib.abstract(mcfg, hcfg)
  abstract = abstract["heads"]
  block_cfg = dataclasses.replace(mcfg, d_ff=d_ff)
  dtype = np.dtype(W.np_dtype_of(mcfg.param_dtype))
  tree, used = None, set()
  for i in range(n):
    names, proj = _module_names(layout, block_cfg, mcfg.n_layers, i)
    tree = W.fill(abstract, names, tensors, mcfg.param_dtype, where, tree)
    w = _tensor(tensors, proj, (mcfg.d_model, 2 * mcfg.d_model), where)
    first, second = w[:, : mcfg.d_model], w[:, mcfg.d_model:]
    # MiMo projects cat[hidden, embedding]; DeepSeek cat[embedding, hidden].
    wh, we = (first, second) if layout == "mimo" else (second, first)
    W.put(tree, ("modules", i, "wh_DE"), np.ascontiguousarray(wh.T).astype(dtype))
    W.put(tree, ("modules", i, "we_DE"), np.ascontiguousarray(we.T).astype(dtype))
    used |= {x for x, _, _ in names} | {proj}
  if layout == "deepseek":
    used |= _check_shared_copies(tensors, mcfg, n, where)
  extra = sorted(names_in - used)
  if extra:
    raise HFImportError(f"{where}: unexpected MTP tensors {extra[:5]}")
  return hcfg, tree


def _tensor(tensors: dict, name: str, shape: tuple, where: str) -> np.ndarray:
  if name not in tensors:
    raise HFImportError(f"{where}: missing tensor {name}")
  if tuple(tensors[name].shape) != shape:
    raise HFImportError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, "
                        f"config.json implies {shape}")
  return tensors[name]


def _check_shared_copies(tensors: dict, mcfg: ModelConfig, n: int, where: str) -> set[str]:
  """DeepSeek stores the embedding and the unembedding again with each module; mtp-jax's modules
  share the trunk's, so the copies must equal them."""
  head = "model.embed_tokens.weight" if mcfg.tie_embeddings else "lm_head.weight"
  used = set()
  for i in range(n):
    p = _prefix("deepseek", mcfg.n_layers, i)
    for name, trunk_name in ((p + "shared_head.head.weight", head),
                             (p + "embed_tokens.weight", "model.embed_tokens.weight")):
      if name in tensors:
        if not np.array_equal(tensors[name], tensors[trunk_name]):
          raise HFImportError(f"{where}: tensor {name} differs from {trunk_name} (the modules "
                              "predict through the trunk's own)")
        used.add(name)
  return used


def medusa_heads(path: str, mcfg: ModelConfig):
  """-> (HeadsConfig, heads params) of Medusa-1 heads: head i = L residual SiLU blocks and its own
  lm_head; tensor names with or without the `medusa_head.` prefix."""
  tensors = {k.removeprefix("medusa_head."): v for k, v in W.read_file(path).items()}
  heads = sorted({int(k.split(".")[0]) for k in tensors if k.split(".")[0].isdigit()})
  if not heads or heads != list(range(len(heads))):
    raise HFImportError(f"{path}: Medusa heads are named '{{i}}.{{j}}.linear.weight', heads "
                        f"0..K-1 (found heads {heads[:8]})")
  k = len(heads)
  layers = len({k_.split(".")[1] for k_ in tensors if k_.startswith("0.") and ".linear." in k_})
  d, v = mcfg.d_model, mcfg.vocab_size
  w_KLDE, b_KLE, lm_KDV, used = [], [], [], set()
  for i in range(k):
    w_KLDE.append([_tensor(tensors, f"{i}.{j}.linear.weight", (d, d), path).T
                   for j in range(layers)])
    b_KLE.append([_tensor(tensors, f"{i}.{j}.linear.bias", (d,), path) for j in range(layers)])
    lm_KDV.append(_tensor(tensors, f"{i}.{layers}.weight", (v, d), path).T)
    used |= {f"{i}.{j}.linear.{t}" for j in range(layers) for t in ("weight", "bias")}
    used.add(f"{i}.{layers}.weight")
  extra = sorted(set(tensors) - used)
  if extra:
    raise HFImportError(f"{path}: unexpected Medusa tensors {extra[:5]}")
  dtype = np.dtype(W.np_dtype_of(mcfg.param_dtype))
  arr = lambda x: np.ascontiguousarray(np.asarray(x)).astype(dtype)
  w, b = np.asarray(w_KLDE), np.asarray(b_KLE)              # [K, L, D, D], [K, L, D]
  params = {"w_KDE": arr(w[:, 0]), "b_KE": arr(b[:, 0]), "unembed_KDV": arr(np.stack(lm_KDV))}
  if layers > 1:
    params.update(wx_KLDE=arr(w[:, 1:]), bx_KLE=arr(b[:, 1:]))
  return HeadsConfig(kind="parallel", num=k, layers=layers, own_unembed=True), params


# ----------------------------------------------------------------------------- export


def export_sequential(layout: str, hcfg: HeadsConfig, heads: dict, mcfg: ModelConfig,
                      trunk_tensors: dict) -> dict:
  """The HF-named tensors of the modules (heads: flat '/'-joined params), to go into
  model.safetensors beside the trunk's."""
  block_cfg = dataclasses.replace(mcfg, d_ff=hcfg.module_d_ff or mcfg.d_ff)
  out = {}
  for i in range(hcfg.num):
    names, proj = _module_names(layout, block_cfg, mcfg.n_layers, i)
    for name, path, kind in names:
      out[name] = np.ascontiguousarray(W.to_hf(heads["/".join(map(str, path))], kind))
    wh, we = heads[f"modules/{i}/wh_DE"].T, heads[f"modules/{i}/we_DE"].T
    out[proj] = np.ascontiguousarray(np.concatenate([wh, we] if layout == "mimo" else [we, wh],
                                                    axis=1))
    if layout == "deepseek":
      p = _prefix(layout, mcfg.n_layers, i)
      head = "model.embed_tokens.weight" if mcfg.tie_embeddings else "lm_head.weight"
      out[p + "shared_head.head.weight"] = trunk_tensors[head]
      out[p + "embed_tokens.weight"] = trunk_tensors["model.embed_tokens.weight"]
  return out


def export_medusa(hcfg: HeadsConfig, heads: dict) -> dict:
  """Medusa-1's `medusa_lm_head.safetensors` tensors from parallel heads with own_unembed."""
  out = {}
  for i in range(hcfg.num):
    for j in range(hcfg.layers):
      w = heads["w_KDE"][i] if j == 0 else heads["wx_KLDE"][i, j - 1]
      b = heads["b_KE"][i] if j == 0 else heads["bx_KLE"][i, j - 1]
      out[f"{i}.{j}.linear.weight"] = np.ascontiguousarray(w.T)
      out[f"{i}.{j}.linear.bias"] = np.ascontiguousarray(b)
    out[f"{i}.{hcfg.layers}.weight"] = np.ascontiguousarray(heads["unembed_KDV"][i].T)
  return out
