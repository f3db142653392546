"""Scale-out on JAX's own SPMD partitioner: a ('data', 'model') mesh, logical axis names, rules.

Every parameter's name ends in the letters of its dimensions (`wq_DNH`, `embed_VD`, `w_KDE`; see
config.py), so its logical axes are read off its name: V vocab, D / E embed, F mlp, N heads,
G kv_heads, H head_dim, K heads_stack, L layers_stack. RMSNorm `scale`s are (embed,). The same
holds for any tree keyed by parameter names (gradients, the optimizer's moments). Rules
(`MeshConfig.rules`) map a logical name to a mesh axis or to nothing (replicated); a dimension
that the mesh axis does not divide is replicated instead (noted by `describe`), so every model
runs on every mesh.

The decode state is sharded by role: slots on 'data' (every [B, ...] array), and the KV caches'
kv_heads on 'model'. Small per-row vectors and the step ring are replicated so that every host
can read them.

Multi-host: `initialize_distributed` wraps `jax.distributed.initialize`; each process then builds
the same global batch (the data iterator is deterministic) and keeps only its own shards
(`put_batch`).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtp_jax.config import AXES, ConfigError, parse_rules, parse_shape  # noqa: F401 (re-exported)

LETTERS = {"V": "vocab", "D": "embed", "E": "embed", "F": "mlp", "N": "heads", "G": "kv_heads",
           "H": "head_dim", "K": "heads_stack", "L": "layers_stack"}


def make_mesh(spec: str = "", devices=None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = parse_shape(spec)
  fill = [a for a, s in shape.items() if s == -1]
  if len(fill) > 1:
    raise ConfigError(f"mesh={spec!r}: at most one axis may be -1")
  known = math.prod(s for s in shape.values() if s != -1)
  if not fill and known < len(devices):
    devices = devices[:known]          # an explicit smaller mesh uses the first devices
  if fill:
    if len(devices) % known:
      raise ConfigError(f"mesh={spec!r}: {len(devices)} devices are not a multiple of {known}")
    shape[fill[0]] = len(devices) // known
  if math.prod(shape.values()) != len(devices):
    raise ConfigError(f"mesh={spec!r}: needs {math.prod(shape.values())} devices, "
                      f"{len(devices)} are visible")
  arr = np.asarray(devices, dtype=object).reshape(shape["data"], shape["model"])
  return Mesh(arr, AXES)


def logical_axes(name: str, ndim: int) -> tuple[str | None, ...]:
  """Logical axis names of a parameter from its name's dimension letters."""
  if name == "scale" and ndim == 1:
    return ("embed",)
  m = re.search(r"_([A-Z]+)$", name)
  if not m or len(m.group(1)) != ndim:
    return (None,) * ndim
  return tuple(LETTERS.get(c) for c in m.group(1))


def spec_for(logical: tuple, shape: tuple, mesh: Mesh, rules: dict) -> P:
  used, out = set(), []
  for name, dim in zip(logical, shape):
    axis = rules.get(name) if name else None
    if axis is None or axis in used or dim % mesh.shape[axis]:
      out.append(None)
    else:
      out.append(axis)
      used.add(axis)
  return P(*out)


def _last_name(path) -> str:
  for entry in reversed(path):
    key = getattr(entry, "key", getattr(entry, "name", None))
    if isinstance(key, str):
      return key
  return ""


def tree_shardings(tree, mesh: Mesh, rules: dict):
  """NamedShardings for a tree of arrays keyed by parameter names (params, grads, opt state)."""
  def one(path, x):
    shape = tuple(np.shape(x))
    return NamedSharding(mesh, spec_for(logical_axes(_last_name(path), len(shape)), shape, mesh,
                                        rules))
  return jax.tree_util.tree_map_with_path(one, tree)


def with_shardings(abstract_tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract_tree, shardings)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))


def put_batch(batch: np.ndarray, mesh: Mesh):
  """A global host batch -> an array sharded on 'data'; each process materialises only its own
  shards (multi-host safe). Rows must divide by the data axis."""
  sharding = batch_sharding(mesh, batch.ndim)
  if batch.shape[0] % mesh.shape["data"]:
    raise ConfigError(f"batch of {batch.shape[0]} rows does not divide over "
                      f"data={mesh.shape['data']} devices")
  return jax.make_array_from_callback(batch.shape, sharding, lambda idx: batch[idx])


def decode_state_shardings(state_abstract, mesh: Mesh, batch_size: int,
                           cache_paths=("trunk", "draft"),
                           batch_paths=(("rows", "tokens"), ("drafts", "logq"))):
  """Slots on 'data' for the large [B, ...] arrays (tokens, drafts' distributions, caches with
  kv_heads on 'model'); everything else replicated."""
  data = mesh.shape["data"]

  def one(path, x):
    names = [getattr(e, "name", getattr(e, "key", None)) for e in path]
    shape = tuple(x.shape)
    if any(n in cache_paths for n in names) and len(shape) in (3, 4):
      # [B, S, G, H] K/V, [B, S, G] an int8 cache's scales
      g_axis = "model" if shape[2] % mesh.shape["model"] == 0 else None
      b_axis = "data" if shape[0] % data == 0 else None
      return NamedSharding(mesh, P(b_axis, None, g_axis, *([None] * (len(shape) - 3))))
    if tuple(names[:2]) in batch_paths and shape[0] == batch_size \
        and batch_size % data == 0:
      return NamedSharding(mesh, P("data", *([None] * (len(shape) - 1))))
    return NamedSharding(mesh, P())
  return jax.tree_util.tree_map_with_path(one, state_abstract)


def bytes_per_device(tree) -> int:
  """Bytes of a sharded tree held by the first device (the largest share under these rules)."""
  dev = None
  total = 0
  for x in jax.tree.leaves(tree):
    shards = x.addressable_shards
    dev = dev or shards[0].device
    total += sum(s.data.nbytes for s in shards if s.device == dev)
  return total


def describe(mesh: Mesh, tree, rules: dict) -> list[str]:
  """Lines naming the parameters whose sharded dimension fell back to replication."""
  out = []
  def one(path, x):
    name = _last_name(path)
    logical = logical_axes(name, len(np.shape(x)))
    for lname, dim in zip(logical, np.shape(x)):
      axis = rules.get(lname) if lname else None
      if axis and dim % mesh.shape[axis]:
        out.append(f"{jax.tree_util.keystr(path)}: {lname}={dim} not divisible by "
                   f"{axis}={mesh.shape[axis]}, replicated")
  jax.tree_util.tree_map_with_path(one, tree)
  return out


def initialize_distributed(coordinator: str, num_processes: int, process_id: int):
  """Multi-host start (before any other JAX call): one process per host."""
  if coordinator:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
