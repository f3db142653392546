"""Files on disk: orbax checkpoints of a training run, and the model-directory format.

A model directory holds `config.json` (model + heads), `tokenizer.json` and `params/` (an orbax
checkpoint of the parameter pytree). A training workdir holds `checkpoints/<step>/` with the
parameters, the optimizer state and the data-iterator state. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from mtp_jax import config as config_lib
from mtp_jax.formats import chat
from mtp_jax.formats.tokenizer import Tokenizer
from mtp_jax.models import model as model_lib


class ModelDirError(ValueError):
  """A model directory that is missing, incomplete, damaged or inconsistent with its config."""


class TrainCheckpointer:
  """Parameters, optimizer state and data-iterator state of a training run, by step."""

  def __init__(self, directory: str, keep: int):
    # Synchronous saves: the train step donates its buffers, so a save must finish reading them
    # before the next step is dispatched.
    self.manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, params, opt_state, data_state: dict):
    self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        data=ocp.args.JsonSave(data_state)), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, abstract_params, abstract_opt_state):
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(
          params=ocp.args.StandardRestore(abstract_params),
          opt_state=ocp.args.StandardRestore(abstract_opt_state),
          data=ocp.args.JsonRestore()))
    except Exception as e:
      raise ModelDirError(f"checkpoint at step {step} in {self.manager.directory} cannot be "
                          f"restored: {type(e).__name__}: {_first_line(e)}") from e
    return out.params, out.opt_state, out.data

  def close(self):
    self.manager.close()


def _first_line(e: Exception) -> str:
  return (str(e).strip().splitlines() or [""])[0][:300]


def _cast(params, dtype):
  # jax arrays stay where they are (sharded saves need no gather onto one host).
  return jax.tree.map(lambda x: x.astype(dtype) if isinstance(x, jax.Array)
                      else np.asarray(x).astype(dtype), params)


def save_model_dir(path: str, cfg: config_lib.Config, params, tokenizer: Tokenizer,
                   dtype: str = "float32", hf_config: dict | None = None,
                   mtp_layout: str = ""):
  """Writes a complete model directory; an existing one at `path` is replaced. `hf_config` (an
  imported model's HF config.json) is kept in config.json so the trunk can be exported back, and
  `mtp_layout` (hf_mtp.py: the published layout its heads were imported from) so the heads go
  back to it."""
  path = os.path.abspath(path)
  tmp = path + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  meta = dict(config_lib.model_dir_config(cfg), tokenizer=tokenizer.special_tokens())
  if hf_config:
    meta["hf_config"] = hf_config
  if mtp_layout:
    meta["mtp_layout"] = mtp_layout
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(meta, f, indent=2)
  tokenizer.save(os.path.join(tmp, "tokenizer.json"))
  if tokenizer.chat_template:
    with open(os.path.join(tmp, chat.TEMPLATE_FILE), "w", encoding="utf-8") as f:
      f.write(tokenizer.chat_template)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(os.path.join(tmp, "params"), _cast(params, jnp.dtype(dtype)))
  ckptr.wait_until_finished()
  shutil.rmtree(path, ignore_errors=True)
  os.replace(tmp, path)


def load_model_dir(path: str, shardings=None):
  """-> (ModelConfig, HeadsConfig, params, Tokenizer). Any problem raises one ModelDirError.
  `shardings` (a tree of NamedShardings like the params): restore straight onto that mesh, in
  model.param_dtype; a checkpoint written from any mesh restores onto any other."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise ModelDirError(f"model directory not found: {path}")
  for name in ("config.json", "tokenizer.json", "params"):
    if not os.path.exists(os.path.join(path, name)):
      raise ModelDirError(f"{path}: missing {name} (a model directory holds config.json, "
                          "tokenizer.json and params/)")
  cfg_path = os.path.join(path, "config.json")
  try:
    with open(cfg_path) as f:
      model_cfg, heads_cfg = config_lib.load_model_dir_config(f.read(), cfg_path)
  except config_lib.ConfigError as e:
    raise ModelDirError(f"{cfg_path}: {e}") from None
  tokenizer = load_tokenizer(path)
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ModelDirError(f"{path}: tokenizer has {tokenizer.vocab_size} tokens but "
                        f"model.vocab_size={model_cfg.vocab_size}")
  _, expected = model_lib.abstract(model_cfg, heads_cfg)
  params_path = os.path.join(path, "params")
  if shardings is None:
    # One device, whatever mesh wrote the checkpoint (its saved shardings are not reused).
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, expected)
  return model_cfg, heads_cfg, _restore_sharded(params_path, expected, shardings, path), tokenizer


def _restore_sharded(params_path, expected, shardings, where):
  try:
    meta = ocp.StandardCheckpointer().metadata(params_path)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    stored = _conform(expected, tree)
    check_params_match(expected, stored, where)
    # Restore in the stored dtype onto the mesh, then cast there (no host round trip).
    target = jax.tree.map(lambda e, m, s: jax.ShapeDtypeStruct(e.shape, m.dtype, sharding=s),
                          expected, stored, shardings)
    restored = ocp.StandardCheckpointer().restore(params_path, target)
  except ModelDirError:
    raise
  except Exception as e:
    raise ModelDirError(f"{params_path}: damaged or unreadable checkpoint "
                        f"({type(e).__name__}: {_first_line(e)})") from None
  restored = _conform(expected, restored)
  return jax.tree.map(lambda e, x: x.astype(e.dtype), expected, restored)


def read_model_config(path: str):
  """-> (ModelConfig, HeadsConfig) of a model directory, without reading its parameters."""
  cfg_path = os.path.join(os.path.abspath(path), "config.json")
  if not os.path.exists(cfg_path):
    raise ModelDirError(f"{os.path.abspath(path)}: missing config.json (not a model directory)")
  try:
    with open(cfg_path) as f:
      return config_lib.load_model_dir_config(f.read(), cfg_path)
  except config_lib.ConfigError as e:
    raise ModelDirError(f"{cfg_path}: {e}") from None


def read_meta(path: str) -> dict:
  """The sections of a model directory's config.json besides model and heads: `tokenizer`
  (special tokens) and, for imported models, `hf_config`."""
  cfg_path = os.path.join(os.path.abspath(path), "config.json")
  try:
    with open(cfg_path) as f:
      d = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ModelDirError(f"{cfg_path}: cannot be read ({e})") from None
  return {k: v for k, v in d.items() if k not in ("model", "heads")}


def load_tokenizer(path: str) -> Tokenizer:
  """The tokenizer of a model directory, with the special tokens its config.json names."""
  special = read_meta(path).get("tokenizer", {})
  template_path = os.path.join(os.path.abspath(path), chat.TEMPLATE_FILE)
  if os.path.exists(template_path):
    with open(template_path, encoding="utf-8") as f:
      special = dict(special, chat_template=f.read())
  try:
    return Tokenizer.load(os.path.join(os.path.abspath(path), "tokenizer.json"), **special)
  except (ValueError, TypeError) as e:
    raise ModelDirError(f"{os.path.abspath(path)}: {e}") from None


def check_params_match(expected, actual, where: str):
  exp = dict(_flat(expected))
  act = dict(_flat(actual))
  missing = sorted(set(exp) - set(act))
  extra = sorted(set(act) - set(exp))
  if missing or extra:
    raise ModelDirError(f"{where}: parameters do not match config.json "
                        f"(missing: {missing[:5]}, unexpected: {extra[:5]})")
  for k in sorted(exp):
    if tuple(exp[k].shape) != tuple(np.shape(act[k])):
      raise ModelDirError(f"{where}: parameter {k} has shape {tuple(np.shape(act[k]))} but "
                          f"config.json implies {tuple(exp[k].shape)}")


def _conform(expected, actual):
  """`actual` rebuilt with the keys of `expected` (orbax stores integer keys as strings)."""
  if isinstance(expected, dict):
    return {k: _conform(v, actual[str(k)] if str(k) in actual else actual[k])
            for k, v in expected.items()}
  return actual


def _flat(tree, prefix=""):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _flat(v, f"{prefix}/{k}" if prefix else str(k))
  else:
    yield prefix, tree
