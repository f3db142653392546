"""Function-preserving widening of a model (Net2Net-style), for benchmarks in the memory-bound
regime with a real model's acceptance.

Every hidden unit of the trunk and heads is duplicated n times: the residual width D, the MLP
width F, the heads' width E and the attention heads N and kv heads G (each head copied whole; the
head dim H, the vocabulary V and the head count K stay). A widened activation is n copies of the
original one side by side (`x' = [x, x, ..., x]`), so:
  - a weight read by a matmul over a widened axis is tiled on its widened axes and divided by n
    (the n copies of each input unit sum back to one);
  - an embedding, a bias or an RMSNorm scale is tiled only. RMSNorm over the copies equals the
    original's, since every unit is repeated equally: the mean square is unchanged;
  - attention heads are copied as whole blocks (head j*N + a is a copy of head a), so that the
    grouped-query grouping (query head i reads kv head i // (N/G)) maps copies onto copies; the
    output projection is split over the copies like any matmul;
  - tied embeddings become an untied unembedding (the tied one would read n copies and scale by
    (nD)^-0.5 instead of D^-0.5): U' = tile(E^T) / n * D^-0.5.
Outputs are unchanged up to rounding: the same logits, greedy tokens and so acceptance, with about
n^2 times the bytes per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.config import HeadsConfig, ModelConfig
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.models import model as model_lib

WIDENED = set("DEFNG")      # axes whose units are duplicated
KEPT = set("HVKL")          # head dim, vocabulary, head count, layers per head


def _axes(name: str) -> str:
  """The dimension letters of a parameter, from its name ('wq_DNH' -> 'DNH'; a norm's 'scale'
  is over D)."""
  if name == "scale":
    return "D"
  letters = name.rsplit("_", 1)[-1]
  if "_" not in name or not set(letters) <= WIDENED | KEPT:
    raise ValueError(f"widen: parameter {name!r} has no known dimension letters")
  return letters


def _widen_leaf(name: str, x: np.ndarray, n: int) -> np.ndarray:
  axes = _axes(name)
  if len(axes) != x.ndim:
    raise ValueError(f"widen: {name} has shape {x.shape}, letters {axes!r}")
  reps = [n if a in WIDENED else 1 for a in axes]
  y = np.tile(x, reps)
  # A matmul weight (not an embedding, bias or norm scale) reads n copies of each input unit.
  if name != "embed_VD" and name != "scale" and not name.startswith("b"):
    y = y / np.asarray(n, x.dtype)
  return y.astype(x.dtype)


def _widen_tree(tree, n: int, name: str = ""):
  if isinstance(tree, dict):
    return {k: _widen_tree(v, n, str(k)) for k, v in tree.items()}
  return _widen_leaf(name, np.asarray(tree), n)


def widen_config(mcfg: ModelConfig, hcfg: HeadsConfig, n: int):
  if n < 1:
    raise ValueError(f"widen: factor {n} must be >= 1")
  mcfg2 = dataclasses.replace(
      mcfg, d_model=n * mcfg.d_model, n_heads=n * mcfg.n_heads, n_kv_heads=n * mcfg.n_kv_heads,
      d_ff=n * mcfg.d_ff, head_size=mcfg.head_dim, tie_embeddings=False)
  hcfg2 = dataclasses.replace(hcfg, module_d_ff=n * hcfg.module_d_ff)
  return mcfg2, hcfg2


def widen_params(mcfg: ModelConfig, hcfg: HeadsConfig, params, n: int):
  """-> (ModelConfig, HeadsConfig, params) of the model widened n times (see the module doc)."""
  mcfg2, hcfg2 = widen_config(mcfg, hcfg, n)
  host = jax.tree.map(np.asarray, params)
  out = _widen_tree(host, n)
  if mcfg.tie_embeddings:
    emb_VD = host["trunk"]["embed_VD"].astype(np.float32)
    scale = mcfg.d_model ** -0.5 if mcfg.tied_logits_scale else 1.0
    dtype = host["trunk"]["embed_VD"].dtype
    out["trunk"]["unembed_DV"] = (np.tile(emb_VD.T, (n, 1)) * (scale / n)).astype(dtype)
  _, expected = model_lib.abstract(mcfg2, hcfg2)
  ckpt_lib.check_params_match(expected, out, f"widened x{n}")
  return mcfg2, hcfg2, jax.tree.map(jnp.asarray, out)


def parse_spec(spec: str) -> tuple[int, str]:
  """'widen:N:DIR' -> (N, DIR)."""
  parts = spec.split(":", 2)
  if len(parts) != 3 or parts[0] != "widen" or not parts[1].isdigit() or int(parts[1]) < 1:
    raise ValueError(f"--model={spec}: expected widen:N:DIR with an integer N >= 1")
  return int(parts[1]), parts[2]


def load_widened(spec: str):
  """'widen:N:DIR' -> (ModelConfig, HeadsConfig, params, Tokenizer) of DIR's model widened N
  times."""
  n, path = parse_spec(spec)
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(path)
  return (*widen_params(mcfg, hcfg, params, n), tok)
