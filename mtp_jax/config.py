"""Typed, frozen, validated configuration.

Dimension letters used across the package (named once, here):
  B batch, T query length, S cache (key) length, D model width, N query heads,
  G kv heads, H head dim, F MLP width, V vocabulary, K MTP heads, L layers.

Named configurations live in `configs/*.py` as ml_collections ConfigDicts (so that the CLI can
override any field with `--config.section.field=value`); `Config.from_dict` turns one into these
dataclasses and validates every field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping


class ConfigError(ValueError):
  """An impossible configuration value; the message names the field and the value."""


def fail(field: str, value: Any, why: str):
  raise ConfigError(f"{field}={value!r}: {why}")


def _positive(obj, *names):
  prefix = type(obj).SECTION
  for name in names:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      fail(f"{prefix}.{name}", value, "must be an integer >= 1")


DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The trunk: a Llama-style decoder."""
  SECTION = "model"
  vocab_size: int = 512
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  d_ff: int = 192
  max_seq_len: int = 256
  rope_theta: float = 10000.0
  # RoPE frequency scaling of long-context checkpoints (the HF `rope_parameters` kinds):
  # 'none', 'linear' (factor), 'llama3' (factor, low/high_freq_factor, original_max_len),
  # 'yarn' (factor, original_max_len, beta_fast/slow, attention_factor, truncate).
  rope_scaling: str = "none"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 0
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_attention_factor: float = 1.0  # yarn: multiplies cos and sin
  rope_truncate: bool = True
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  # Tied logits are scaled by d_model**-0.5 (natively trained models); imported checkpoints
  # use the embedding matrix as it is.
  tied_logits_scale: bool = True
  head_size: int = 0                # per-head width; 0 = d_model / n_heads
  qkv_bias: bool = False            # biases on the q, k, v projections (Qwen2)
  out_bias: bool = False            # bias on the attention output projection
  # Storage dtype of parameters; 'auto' compute dtype means f32 on CPU, bf16 elsewhere.
  param_dtype: str = "float32"
  dtype: str = "auto"

  def __post_init__(self):
    _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
              "max_seq_len")
    if self.head_size < 0:
      fail("model.head_size", self.head_size, "must be >= 0 (0 = d_model / n_heads)")
    if not self.head_size and self.d_model % self.n_heads:
      fail("model.n_heads", self.n_heads, f"must divide model.d_model={self.d_model}")
    if self.n_heads % self.n_kv_heads:
      fail("model.n_kv_heads", self.n_kv_heads, f"must divide model.n_heads={self.n_heads}")
    if self.head_dim % 2:
      fail("model.head_size" if self.head_size else "model.n_heads",
           self.head_size or self.n_heads, f"head dim {self.head_dim} must be even for RoPE")
    if not self.rope_theta > 0:
      fail("model.rope_theta", self.rope_theta, "must be > 0")
    if self.rope_scaling not in ROPE_SCALINGS:
      fail("model.rope_scaling", self.rope_scaling, f"must be one of {ROPE_SCALINGS}")
    if self.rope_scaling != "none" and not self.rope_factor >= 1.0:
      fail("model.rope_factor", self.rope_factor, "must be >= 1")
    if self.rope_scaling in ("llama3", "yarn") and self.rope_original_max_len < 1:
      fail("model.rope_original_max_len", self.rope_original_max_len,
           f"must be >= 1 with model.rope_scaling={self.rope_scaling!r}")
    if self.rope_scaling == "llama3" and not (
        0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
      fail("model.rope_low_freq_factor", self.rope_low_freq_factor,
           f"must be > 0 and < model.rope_high_freq_factor={self.rope_high_freq_factor}")
    if not 0 < self.norm_eps < 1:
      fail("model.norm_eps", self.norm_eps, "must be in (0, 1)")
    if self.param_dtype not in DTYPES:
      fail("model.param_dtype", self.param_dtype, f"must be one of {DTYPES}")
    if self.dtype not in DTYPES + ("auto",):
      fail("model.dtype", self.dtype, f"must be 'auto' or one of {DTYPES}")

  @property
  def head_dim(self) -> int:
    return self.head_size or self.d_model // self.n_heads


HEAD_KINDS = ("parallel", "sequential")


@dataclasses.dataclass(frozen=True)
class HeadsConfig:
  """Multi-token-prediction heads: head i (1..K) predicts token t+1+i from h_t.

  'parallel': K independent residual blocks on h_t. 'sequential' (DeepSeek-V3 MTP modules):
  module i combines module i-1's hidden state with the embedding of token t+i and runs one
  transformer block, so each draft sees the drafts before it."""
  SECTION = "heads"
  kind: str = "parallel"
  num: int = 3
  layers: int = 1                   # parallel: residual SiLU layers per head (Medusa's num_layers)
  module_d_ff: int = 0              # sequential: MLP width of each module's block; 0 = model.d_ff
  carry: str = "raw"                # sequential: what module i hands module i+1, its block's
                                    # output (DeepSeek-V3) or that output normed (GLM-4.5, MiMo)
  trunk_state: str = "normed"       # sequential: the trunk's hidden state module 1 reads, after
                                    # its final norm or before it (MiMo)
  zero_first_embed: bool = False    # sequential: module 1 reads a zero embedding at trunk
                                    # position 0 (vLLM's MiMo and DeepSeek MTP layers)
  own_unembed: bool = False         # parallel: each head has its own [D, V] unembedding
                                    # (Medusa-1's per-head lm_head), not the trunk's

  def __post_init__(self):
    if self.kind not in HEAD_KINDS:
      fail("heads.kind", self.kind, f"must be one of {HEAD_KINDS}")
    _positive(self, "num", "layers")
    for name, allowed in (("carry", ("raw", "normed")), ("trunk_state", ("normed", "pre_norm"))):
      if getattr(self, name) not in allowed:
        fail(f"heads.{name}", getattr(self, name), f"must be one of {allowed}")
      if getattr(self, name) != allowed[0] and self.kind != "sequential":
        fail(f"heads.{name}", getattr(self, name), "applies to sequential heads only")
    if self.zero_first_embed and self.kind != "sequential":
      fail("heads.zero_first_embed", True, "applies to sequential heads only")
    if self.own_unembed and self.kind != "parallel":
      fail("heads.own_unembed", True, "applies to parallel heads only (heads.kind='parallel')")
    if self.layers > 1 and self.kind != "parallel":
      fail("heads.layers", self.layers, "applies to parallel heads only (heads.kind='parallel')")
    if self.module_d_ff < 0:
      fail("heads.module_d_ff", self.module_d_ff, "must be >= 0 (0 = model.d_ff)")
    if self.module_d_ff and self.kind != "sequential":
      fail("heads.module_d_ff", self.module_d_ff,
           "applies to sequential heads only (heads.kind='sequential')")


MODES = ("joint", "heads_only")
DISTILL_SOURCES = ("corpus", "generated")
DISTILL_TARGETS = ("hard", "soft")
DRAFTERS = ("heads", "ngram", "model")
ATTENTIONS = ("dense", "blocked")
KV_DTYPES = ("auto", "float32", "bfloat16", "int8", "float8_e4m3fn")
DATA_FORMATS = ("files", "jsonl")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """A corpus is a directory of text files ('' means the running Python's standard library), or
  with format='jsonl' one JSONL file of records {"text": ...} or {"messages": [...]}
  (training/jsonl.py)."""
  SECTION = "data"
  format: str = "files"             # files (corpus_dir, glob) | jsonl (the file data.path)
  corpus_dir: str = ""
  glob: str = "**/*.py"
  exclude: str = "site-packages"    # path fragment whose files are skipped
  path: str = ""                    # format='jsonl': the JSONL file
  heldout_permille: int = 20        # files (records) whose path (JSON) hash falls below this go
                                    # to held-out
  max_files: int = 0                # 0 = all files (sorted by path, then capped)
  tokenizer_train_bytes: int = 8_000_000
  tokenizer: str = ""               # reuse this model directory's tokenizer ('' = train one)
  seq_len: int = 128                # positions trained per window (heads see K more tokens)
  seed: int = 0

  def __post_init__(self):
    _positive(self, "seq_len", "tokenizer_train_bytes")
    if not 0 <= self.heldout_permille < 1000:
      fail("data.heldout_permille", self.heldout_permille, "must be in [0, 1000)")
    if self.max_files < 0:
      fail("data.max_files", self.max_files, "must be >= 0")
    if self.format not in DATA_FORMATS:
      fail("data.format", self.format, f"must be one of {DATA_FORMATS}")
    if self.format == "jsonl":
      if self.corpus_dir:
        fail("data.corpus_dir", self.corpus_dir, "names a directory of text files "
             "(data.format='files'); a JSONL corpus is named by data.path")
      if not self.path:
        fail("data.path", self.path, "must name a JSONL file with data.format='jsonl'")
      if self.max_files:
        fail("data.max_files", self.max_files, "applies to data.format='files' only")
    elif self.path:
      fail("data.path", self.path, "applies to data.format='jsonl' only (a directory of text "
           "files is data.corpus_dir)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  SECTION = "train"
  mode: str = "joint"
  init_from: str = ""               # a model directory to start from (required by heads_only)
  batch_size: int = 8
  steps: int = 100
  lr: float = 3e-3
  warmup_steps: int = 10
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  grad_clip: float = 1.0
  head_loss_weight: float = 1.0     # lambda in trunk_loss + lambda * mean(head losses)
  head_loss_stride: int = 1         # train heads on every n-th position (cheaper steps)
  distill_source: str = "generated" # heads_only targets: along corpus text or the trunk's own text
  distill_target: str = "hard"      # trunk argmax (hard) or the trunk's distribution (soft)
  distill_prompt_len: int = 32      # corpus prompt length before the trunk's continuation
  checkpoint_every: int = 50
  keep_checkpoints: int = 2
  eval_every: int = 50
  eval_batches: int = 4
  log_every: int = 10
  seed: int = 0
  save_dtype: str = "float32"       # dtype of the parameters in the exported model directory

  def __post_init__(self):
    if self.mode not in MODES:
      fail("train.mode", self.mode, f"must be one of {MODES}")
    _positive(self, "batch_size", "steps", "head_loss_stride", "checkpoint_every", "keep_checkpoints", "eval_every",
              "eval_batches", "log_every", "distill_prompt_len")
    if not self.lr > 0:
      fail("train.lr", self.lr, "must be > 0")
    if self.warmup_steps < 0:
      fail("train.warmup_steps", self.warmup_steps, "must be >= 0")
    if not 0 <= self.min_lr_ratio <= 1:
      fail("train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
    if self.weight_decay < 0:
      fail("train.weight_decay", self.weight_decay, "must be >= 0")
    if not self.grad_clip > 0:
      fail("train.grad_clip", self.grad_clip, "must be > 0")
    if self.head_loss_weight < 0:
      fail("train.head_loss_weight", self.head_loss_weight, "must be >= 0")
    if self.distill_source not in DISTILL_SOURCES:
      fail("train.distill_source", self.distill_source, f"must be one of {DISTILL_SOURCES}")
    if self.distill_target not in DISTILL_TARGETS:
      fail("train.distill_target", self.distill_target, f"must be one of {DISTILL_TARGETS}")
    if self.save_dtype not in DTYPES:
      fail("train.save_dtype", self.save_dtype, f"must be one of {DTYPES}")
    if self.mode == "heads_only" and not self.init_from:
      fail("train.init_from", self.init_from,
           "heads_only training needs a model directory whose trunk it keeps frozen")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static shapes of the decode engine: changing any of these compiles a new engine."""
  SECTION = "decode"
  batch_size: int = 8               # slots B
  max_len: int = 0                  # cache length S_max; 0 = the model's max_seq_len
  k: int = -1                       # drafts verified per step; -1 = all heads, 0 = plain decoding
  ring_size: int = 32               # steps per generate call (ring capacity R)
  min_bucket: int = 16              # smallest prefill bucket (buckets are powers of two)
  adaptive: bool = False            # choose k in 0..k per step from costs and acceptance
  confidence_threshold: float = 0.0 # cut a row's drafts at the first with head prob below this
  accept_window: int = 16           # steps of the ring the acceptance rates are read from
  adapt_every: int = 4              # adaptive: steps run with one choice of k (a segment)
  probe_every: int = 4              # adaptive: the first probe (the end of a plain segment
                                    # drafts one head and checks it against plain decoding)
                                    # after this many plain segments
  adapt_margin: float = 0.06        # adaptive: draft only when expected to beat plain by this
                                    # (the learned costs' error; docs/adaptive.md)
  probe_every_max: int = 64         # adaptive: the probe interval (in segments) doubles after
                                    # each probe that leads to no drafting, up to this (it
                                    # carries across generate calls)
  prefill_rows: int = 8             # prompts prefilled per call when several slots are free
  drafter: str = "heads"            # heads (MTP) | ngram (prompt lookup) | model (a draft model)
  reuse_module: bool = False        # sequential heads: draft k tokens with module 1 applied k times
                                    # (implied for a model with one module and k > 1)
  ngram_n: int = 2                  # ngram: the suffix length looked up in the row's history
  attention: str = "blocked"        # decode attention: dense (reads all max_len positions) |
                                    # blocked (reads blocks up to the longest row; attention.py)
  attention_block: int = 128        # blocked: positions per block (compile-time)
  kv_dtype: str = "auto"            # KV cache storage: auto (the compute dtype) | float32 |
                                    # bfloat16 | int8 | float8_e4m3fn (scale per position, head)
  tree: tuple = ()                  # a token tree (shapes.Tree choices, from shapes.tree_for):
                                    # each step verifies it instead of a chain; () = a chain
  adaptive_trees: tuple = ()        # adaptive: token trees (Tree choices) the controller may
                                    # choose besides the chains (parallel heads only)
  tree_rates: tuple = ()            # adaptive_trees: per head, the measured P(rank i is right)
                                    # (trees.json's rates; shapes.prior_rates if unknown)

  def __post_init__(self):
    _positive(self, "batch_size", "ring_size", "min_bucket", "accept_window", "probe_every",
              "prefill_rows", "adapt_every")
    if not 0.0 <= self.adapt_margin < 1.0:
      fail("decode.adapt_margin", self.adapt_margin, "must be in [0, 1)")
    if self.probe_every_max < self.probe_every:
      fail("decode.probe_every_max", self.probe_every_max,
           f"must be >= decode.probe_every={self.probe_every}")
    if not 0.0 <= self.confidence_threshold < 1.0:
      fail("decode.confidence_threshold", self.confidence_threshold, "must be in [0, 1)")
    if self.max_len < 0:
      fail("decode.max_len", self.max_len, "must be >= 0")
    if self.k < -1:
      fail("decode.k", self.k, "must be -1 (all heads), 0 (plain decoding) or a head count")
    if self.drafter not in DRAFTERS:
      fail("decode.drafter", self.drafter, f"must be one of {DRAFTERS}")
    if self.drafter != "heads" and self.k < 0:
      fail("decode.k", self.k, f"must be set (>= 0) with decode.drafter={self.drafter!r}")
    _positive(self, "ngram_n")
    _positive(self, "attention_block")
    if self.attention not in ATTENTIONS:
      fail("decode.attention", self.attention, f"must be one of {ATTENTIONS}")
    if self.kv_dtype not in KV_DTYPES:
      fail("decode.kv_dtype", self.kv_dtype, f"must be one of {KV_DTYPES}")


AXES = ("data", "model")


def parse_shape(spec: str) -> dict[str, int]:
  """'data:2,model:4' -> {'data': 2, 'model': 4}; '' -> every device on 'data'. -1 fills in."""
  out = {"data": -1, "model": 1} if not spec.strip() else {"data": 1, "model": 1}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    m = re.fullmatch(r"(\w+):(-?\d+)", part)
    if not m or m.group(1) not in AXES:
      raise ConfigError(f"mesh={spec!r}: each entry must be AXIS:SIZE with AXIS in {AXES}")
    size = int(m.group(2))
    if size == 0 or size < -1:
      raise ConfigError(f"mesh={spec!r}: {m.group(1)} size must be >= 1 (or -1: the rest)")
    out[m.group(1)] = size
  return out


def parse_rules(rules: str) -> dict[str, str | None]:
  out = {}
  for part in filter(None, (p.strip() for p in rules.split(","))):
    name, _, axis = part.partition("=")
    axis = axis.strip() or None
    if axis is not None and axis not in AXES:
      raise ConfigError(f"mesh.rules: {name}={axis!r}: the mesh axis must be one of {AXES} or "
                        "empty (replicated)")
    out[name.strip()] = axis
  return out


DEFAULT_RULES = ("batch=data,vocab=model,embed=,mlp=model,heads=model,kv_heads=model,"
                 "head_dim=,heads_stack=,layers_stack=")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """The device mesh ('data', 'model') and the logical-axis -> mesh-axis rules (sharding.py)."""
  SECTION = "mesh"
  shape: str = ""                   # 'data:2,model:4'; '' = every device on 'data'
  rules: str = DEFAULT_RULES        # logical=axis pairs; an empty axis replicates

  def __post_init__(self):
    parse_shape(self.shape)
    parse_rules(self.rules)


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  heads: HeadsConfig = HeadsConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  mesh: MeshConfig = MeshConfig()

  def __post_init__(self):
    # The trunk runs on seq_len + K positions so that every head has targets.
    if self.data.seq_len + self.heads.num > self.model.max_seq_len:
      fail("data.seq_len", self.data.seq_len,
           f"plus heads.num={self.heads.num} must be <= model.max_seq_len={self.model.max_seq_len}")
    if self.train.mode == "heads_only" and self.train.distill_source == "generated":
      if self.train.distill_prompt_len >= self.data.seq_len:
        fail("train.distill_prompt_len", self.train.distill_prompt_len,
             f"must be < data.seq_len={self.data.seq_len}")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Config":
    d = dict(d)
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ConfigError(f"unknown config section(s): {sorted(unknown)}")
    sections = {}
    for f in dataclasses.fields(cls):
      sub = dict(d.get(f.name, {}) or {})
      sections[f.name] = _build(f.type if not isinstance(f.type, str) else _SECTION_TYPES[f.name],
                                f.name, sub)
    return cls(**sections)

  def to_dict(self) -> dict:
    return {f.name: _section_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}


_SECTION_TYPES = {"model": ModelConfig, "heads": HeadsConfig, "data": DataConfig,
                  "train": TrainConfig, "mesh": MeshConfig}


def _section_dict(obj) -> dict:
  return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _build(typ, section: str, values: Mapping[str, Any]):
  names = {f.name: f for f in dataclasses.fields(typ)}
  unknown = set(values) - set(names)
  if unknown:
    raise ConfigError(f"unknown field(s) in {section}: {sorted(unknown)}")
  kwargs = {}
  for name, value in values.items():
    default = getattr(typ, name)
    # Coerce int -> float where the field is a float; reject anything else of the wrong type.
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
      value = float(value)
    if type(default) is not type(value):
      raise ConfigError(f"{section}.{name}={value!r}: must be of type {type(default).__name__}")
    kwargs[name] = value
  return typ(**kwargs)


def model_dir_config(cfg: Config) -> dict:
  """The part of the config that defines a model directory (config.json)."""
  return {"model": _section_dict(cfg.model), "heads": _section_dict(cfg.heads)}


def load_model_dir_config(text: str, source: str = "config.json") -> tuple[ModelConfig, HeadsConfig]:
  try:
    d = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{source}: not valid JSON ({e})") from None
  if not isinstance(d, dict) or "model" not in d or "heads" not in d:
    raise ConfigError(f"{source}: must be an object with 'model' and 'heads' sections")
  return _build(ModelConfig, "model", d["model"]), _build(HeadsConfig, "heads", d["heads"])
