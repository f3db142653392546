"""Sequential heads (DeepSeek-V3 MTP modules): module i combines module i-1's hidden state with
the embedding of the token i ahead, runs one transformer block over its own KV cache (one cache
layer per module, indexed by the position of the module's input token: module i at trunk
position t sits at t + i), and predicts through the shared unembedding."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from mtp_jax.decoding import sampling
from mtp_jax.decoding.drafters.base import DraftInput, DraftSpec, pick
from mtp_jax.models import cache as kv
from mtp_jax.models.heads import first_embed_masked


class SequentialModules:
  def __init__(self, spec: DraftSpec, model_cfg, dtype, reuse_module: bool):
    self.spec, self.model_cfg, self.dtype, self.reuse = spec, model_cfg, dtype, reuse_module
    self.n_mod = 1 if reuse_module else spec.kd

  def init_cache(self, b: int, s: int):
    """-> (one cache layer per module, with room for one step past s; seq_h [B, M, D])."""
    return (self.module_cache(b, s + self.spec.kd + 1),
            jnp.zeros((b, self.n_mod, self.model_cfg.d_model), self.dtype))

  def module_cache(self, b: int, s: int) -> kv.KVCache:
    return kv.init_cache(dataclasses.replace(self.model_cfg, n_layers=self.n_mod), b, s,
                         self.dtype)

  def module(self, m, i: int):
    return m.heads.modules[0 if self.reuse else i]

  def prefill(self, m, dm, tokens_NP, length_N, h_NPD, hist_NS, key, sp, presence_NV,
              sample: bool):
    """Every module over the whole prompt (trunk positions 0..P-1, input positions i..P-1+i);
    module i's last committed trunk position is L-1-i = length - i; then the first drafts."""
    n, p = tokens_NP.shape
    cache = self.module_cache(n, p + self.spec.kd + 1)
    seq_h = jnp.zeros((n, self.n_mod, self.model_cfg.d_model), self.dtype)
    ks, vs, hp = list(cache.k), list(cache.v), h_NPD
    pos = jnp.arange(p)[None]
    for i in range(self.n_mod):
      u = jnp.broadcast_to(pos + i + 1, (n, p))
      e = m.trunk.embed(hist_NS[:, i + 1: i + 1 + p])
      if i == 0:
        e = first_embed_masked(e, u - 1, m.heads_cfg)
      hp, _, (ks[i], vs[i]) = self.module(m, i)(hp, e, u, (ks[i], vs[i]), key_min=i + 1)
      at = jnp.maximum(length_N - i - 1, 0)
      seq_h = seq_h.at[:, i].set(hp[jnp.arange(n), at].astype(seq_h.dtype))
    cache = cache.replace(k=tuple(ks), v=tuple(vs))
    return self.chain(m, seq_h, length_N + 1, cache, key, sp, presence_NV, sample,
                      self.spec.kd) + (seq_h,)

  def draft(self, m, dm, inp: DraftInput, n: int, sample: bool, want_conf: bool,
            ranked: bool = False):
    """The modules' caches take the committed tokens (this step's accepted positions), in the
    same compiled step, then the modules draft in sequence."""
    cache, seq_h = inp.draft_cache, inp.seq_h
    n_upd = min(inp.k, self.n_mod)
    if n_upd:
      cache, seq_h = self.update(m, inp.h_BTD, inp.tokens_BS, inp.start_B, inp.n_B, cache,
                                 seq_h, n_upd, inp.active_B)
    return self.chain(m, seq_h, inp.length_B, cache, inp.key, inp.sp, inp.presence_BV, sample,
                      n, want_conf) + (seq_h,)

  def update(self, m, h_BWD, tokens_BS, start_B, last_B, cache, seq_h, n_upd: int,
             active_B=None):
    """Brings the modules' caches up to date after tokens were committed: module i (1-based)
    runs the window of input-token positions start .. start+W-1 (its trunk positions minus i),
    fed by module i-1's outputs on the same positions (module i-1's window is one position
    later, so its first entry comes from seq_h) and the committed tokens there. Entries past
    the committed length are overwritten once their tokens are known and never read before.
    seq_h[i] <- module i's output at window index last_B (its last committed position)."""
    b, w, _ = h_BWD.shape
    s = tokens_BS.shape[1]
    u = start_B[:, None] + jnp.arange(w)[None]
    e = m.trunk.embed(jnp.take_along_axis(tokens_BS, jnp.clip(u, 0, s - 1), axis=1))
    ks, vs, new_h, h_in, h_prev = list(cache.k), list(cache.v), seq_h, h_BWD, h_BWD
    rows = jnp.arange(b)
    for i in range(n_upd):
      if i > 0:
        h_in = jnp.concatenate([seq_h[:, i - 1][:, None], h_prev[:, : w - 1]], axis=1)
      e_i = first_embed_masked(e, u - 1, m.heads_cfg) if i == 0 else e
      h_prev, _, (ks[i], vs[i]) = self.module(m, i)(h_in, e_i, u, (ks[i], vs[i]), key_min=i + 1)
      h_i = h_prev[rows, last_B]
      if active_B is not None:
        h_i = jnp.where(active_B[:, None], h_i, seq_h[:, i])
      new_h = new_h.at[:, i].set(h_i.astype(new_h.dtype))
    return cache.replace(k=tuple(ks), v=tuple(vs)), new_h

  def chain(self, m, seq_h, length_B, cache, key, sp, presence_BV, sample: bool, n: int,
            want_conf: bool = True):
    """Drafts after a committed length L: draft 1 from module 1's output at its last committed
    position (seq_h[0], trunk position L-2); draft j from module j (or module 1 again with
    reuse_module) at input position L-2+j, fed the previous draft and the previous module's
    state. Its attention skips the module's entries not yet known to be right (past L-1), except
    with reuse_module, where the chain itself wrote them. -> (drafts, logq, conf, cache)."""
    subs = sampling.split_rows(key, self.spec.kd) if sample else None
    ks, vs = list(cache.k), list(cache.v)
    h = seq_h[:, 0]
    first = self.module(m, 0)
    hn = h if first.carry == "normed" else first.out_norm(h)
    drafts, logqs, confs = [], [], []
    limit = None if self.reuse else length_B - 1
    for j in range(n):
      if j > 0:
        layer = 0 if self.reuse else j
        u = (length_B - 1 + j)[:, None]
        e = m.trunk.embed(drafts[-1][:, None])
        hh, hn, (ks[layer], vs[layer]) = self.module(m, j)(
            h[:, None], e, u, (ks[layer], vs[layer]), limit, key_min=layer + 1)
        h, hn = hh[:, 0], hn[:, 0]
      d, logq, conf, presence_BV = pick(m.head_unembed(hn), subs, j, sp, presence_BV, sample,
                                        j < self.spec.conf_cols(n, want_conf))
      drafts.append(d)
      logqs.append(logq)
      confs.append(conf)
    return (jnp.stack(drafts, 1), jnp.stack(logqs, 1), jnp.stack(confs, 1),
            cache.replace(k=tuple(ks), v=tuple(vs)))
