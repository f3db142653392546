"""HF config.json <-> the trunk's ModelConfig, for the Llama family (import: `model_config_from_hf`,
export: `hf_config_for`).

What maps onto the trunk: RoPE theta and the rope kinds `default`, `linear`, `llama3`, `yarn`
(and `dynamic`, which equals `default` up to max_position_embeddings, the import's limit), GQA,
an explicit `head_dim`, tied or untied embeddings, attention biases (Llama's `attention_bias`,
Qwen2's q/k/v biases). A sliding window is exact when no sequence is longer than the window, so
the imported model's `max_seq_len` is capped at it. Anything else the trunk lacks (an unknown
architecture, MoE, another rope kind, partial rotary, another activation, MLP biases) fails with
an `HFImportError` naming the config field and its value.
"""

from __future__ import annotations

import json
import math
import os

from mtp_jax import config as config_lib
from mtp_jax.config import ModelConfig
from mtp_jax.formats.tokenizer import Tokenizer

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MiMoForCausalLM")
_QWEN2 = ("Qwen2ForCausalLM", "MiMoForCausalLM")        # MiMo: a Qwen2 trunk with MTP layers
ROPE_KINDS = ("default", "linear", "llama3", "yarn", "dynamic")
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class HFImportError(ValueError):
  """A HF checkpoint that cannot be imported; the message names the field and its value."""


def _fail(field: str, value, why: str):
  raise HFImportError(f"{field}={value!r}: {why}")


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
  for field in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
    if hf.get(field):
      _fail(field, hf[field], "mixture-of-experts layers are not supported (the trunk and its "
            "MTP modules must be dense)")
  for field in ("kv_lora_rank", "q_lora_rank"):
    if hf.get(field):
      _fail(field, hf[field], "multi-head latent attention (MLA) is not supported")
  archs = hf.get("architectures") or []
  if len(archs) != 1 or archs[0] not in ARCHITECTURES:
    _fail("architectures", archs, f"must be one of {list(ARCHITECTURES)}")
  arch = archs[0]
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

  if arch in _QWEN2:
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
  if arch in _QWEN2:
    sliding_layers = "sliding_attention" in (hf.get("layer_types") or [])
    if not (hf.get("use_sliding_window") or sliding_layers):
      return None
  if window is not None and (not isinstance(window, int) or window < 1):
    _fail("sliding_window", window, "must be null or a positive integer")
  return window


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
