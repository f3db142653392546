"""Drafters: each proposes the next step's drafts from what the step hands it (base.DraftInput).

  parallel.ParallelHeads      the MTP heads on the trunk's last accepted hidden state
  sequential.SequentialModules  DeepSeek-V3 style modules with their own KV caches
  ngram.NGram                 prompt lookup in the row's own history
  draft_model.DraftModel      a separate small model with its own KV cache

Each has init_cache(b, s) -> (draft cache, seq_h), prefill(...) and draft(...), both returning
(drafts, logq, conf, draft cache, seq_h). make() chooses one; nothing else branches on the kind.
Trees (a tree engine's, adaptive k's) draft with the parallel heads only (shape_set.resolve
refuses the others): each head's top_r candidates by rank.
"""

from __future__ import annotations

from mtp_jax.decoding.drafters.base import DraftInput, DraftSpec
from mtp_jax.decoding.drafters.draft_model import DraftModel
from mtp_jax.decoding.drafters.ngram import NGram
from mtp_jax.decoding.drafters.parallel import ParallelHeads
from mtp_jax.decoding.drafters.sequential import SequentialModules


def make(decode_cfg, model_cfg, heads_cfg, dtype, cache_args: tuple, draft_model_cfg=None,
         top_r: int = 0):
  """The drafter of a resolved DecodeConfig (dtype: the compute dtype; cache_args: the trunk's
  kv.init_cache storage arguments, which a draft model's cache shares). With no drafts (k = 0)
  the heads' path drafts nothing, except that a draft model still keeps its cache. top_r: each
  head's candidates by rank (a tree engine's, or the largest of adaptive k's trees; 0: one)."""
  kd = decode_cfg.k
  spec = DraftSpec(kd=kd, vocab_size=model_cfg.vocab_size,
                   conf_threshold=decode_cfg.confidence_threshold,
                   needs_conf=decode_cfg.adaptive or decode_cfg.confidence_threshold > 0,
                   top_r=top_r)
  if decode_cfg.drafter == "model":
    return DraftModel(spec, draft_model_cfg, cache_args)
  if kd == 0 or (decode_cfg.drafter == "heads" and heads_cfg.kind != "sequential"):
    return ParallelHeads(spec)
  if decode_cfg.drafter == "heads":
    return SequentialModules(spec, model_cfg, dtype, decode_cfg.reuse_module)
  return NGram(spec, decode_cfg.ngram_n)


__all__ = ["DraftInput", "DraftSpec", "DraftModel", "NGram", "ParallelHeads",
           "SequentialModules", "make"]
