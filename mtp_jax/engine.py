"""The speculative decode engine: prefill / insert / generate over a fixed-shape DecodeState.

One step, for every row at once (k drafts; k = 0 is plain decoding through the same code):
  1. input [last committed token, d_1..d_k] at positions length-1 .. length-1+k;
  2. the trunk runs the k+1 tokens, writing their K/V into the cache at those positions;
  3. verification keeps the longest acceptable draft prefix and adds one token from the trunk;
  4. commit: the accepted tokens are written and the length advances (rejected drafts are rolled
     back by the length alone: their K/V is masked and later overwritten);
  5. the heads read the hidden state at the last accepted position and draft the next k tokens;
  6. the step's record goes into the ring.
`generate` runs these steps in one jitted `lax.while_loop` (state donated) until `num_steps`
steps ran or every row is done. Rows stop at the end-of-document token, at their own
max_new_tokens, or when the cache is full.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtp_jax import adaptive
from mtp_jax import cache as kv
from mtp_jax import model as model_lib
from mtp_jax import ring as ring_lib
from mtp_jax import sampling
from mtp_jax.config import DecodeConfig, HeadsConfig, ModelConfig


@struct.dataclass
class DecodeState:
  tokens: jax.Array        # [B, S] int32: prompt then generated tokens
  length: jax.Array        # [B] committed tokens (prompt included)
  prompt_len: jax.Array    # [B]
  stop_len: jax.Array      # [B] the length at which the row is finished
  done: jax.Array          # [B] bool (free slots are done)
  drafts: jax.Array        # [B, Kd] drafts for the next step
  draft_logq: jax.Array    # [B, Kd, V] the heads' processed log-probabilities of those drafts
                           # (written by sampled steps; greedy steps leave it as it is)
  draft_conf: jax.Array    # [B, Kd] the heads' confidence (peak probability) per draft
  n_fresh: jax.Array       # [B] drafts made for the coming step (later ones are stale: a step
                           # of the adaptive loop drafts only what the next step may verify)
  cache: kv.KVCache
  draft_cache: kv.KVCache | None  # the draft model's cache (drafter 'model'), or the
                                  # sequential heads' caches (one layer per module), else None
  seq_h: jax.Array | None  # [B, M, D] sequential heads: module i's hidden state at its last
                           # position whose input token is committed (None otherwise)
  key: jax.Array           # [B] one PRNG key per row (a row's stream ignores the other rows)
  temperature: jax.Array   # [B] f32, 0 = greedy
  top_k: jax.Array         # [B] int32, 0 = off
  top_p: jax.Array         # [B] f32, 1 = off
  penalty: jax.Array       # [B] f32 repetition penalty, 1 = off
  ring: ring_lib.Ring
  step: jax.Array          # [] steps run since init (indexes the ring)
  row_steps: jax.Array     # [B] decode steps while the row was active
  row_emitted: jax.Array   # [B] tokens emitted by decode steps
  drafted: jax.Array       # [Kd] drafts verified, per draft position
  accepted: jax.Array      # [Kd] drafts accepted, per draft position
  cond_trials: jax.Array   # [Kd] drafts reached (verified, every draft before them accepted)
  cond_hits: jax.Array     # [Kd] and accepted there; an adaptive engine leaves each row's first
                           # adapt_warmup steps out: the run's conditional acceptance per
                           # position (adaptive.run_rates), the next run's prior
  cond_weight: jax.Array   # [Kd] f32 (adaptive engines): cond_trials, each weighed by the
                           # profile's g at the row's output position (cond_hits / cond_weight:
                           # the run's level)
  pos_trials: jax.Array    # [N] int32: first-position cond_trials per output-position bucket
  pos_hits: jax.Array      # [N] int32: and cond_hits (adaptive.run_profile)
  row_hits: jax.Array      # [B, Kd] f32: the row's drafts accepted per position, since its
                           # insert, decaying over adaptive.ROW_MEMORY_STEPS steps (adaptive
                           # engines only; zeros otherwise)
  row_trials: jax.Array    # [B, Kd] f32: the same for the drafts verified (reached) there
  cost: jax.Array          # [Kd+1] seconds per step with k drafts (adaptive k)
  k_force: jax.Array       # [] -1: the controller chooses k; else this k (calibration)
  closed: jax.Array        # [] bool: no request waits for a slot (the controller then aims at
                           # the end of the job rather than tokens per second; see adaptive.py)
  probe_gap: jax.Array     # [] plain segments between probes (probe_every at the start,
                           # doubling while probes find nothing worth drafting; accept_window
                           # steps after k > 0)
  plain_segs: jax.Array    # [] plain segments ended since the last probe or drafting segment
  seg_k: jax.Array         # [] k of the current segment (a call that begins inside a segment
                           # continues it)
  prior_rate: jax.Array    # [Kd] acceptance per draft position from earlier runs (-1: unknown;
                           # the controller's prior before the ring has counts), a level
  profile: jax.Array       # [N] f32: g per output-position bucket, from earlier runs (all ones:
                           # flat; see adaptive.PROFILE_TOKENS)


@struct.dataclass
class Prefix:
  """The result of prefilling n prompts padded to one bucket: cache rows, the first token."""
  tokens: jax.Array        # [n, P]
  length: jax.Array        # [n] true prompt lengths
  cache: kv.KVCache        # [n, P, G, H] per layer
  draft_cache: kv.KVCache | None   # [n, P + Kd + 1, ...] the draft model's (drafter 'model')
                                   # or the sequential heads' caches
  seq_h: jax.Array | None          # [n, M, D] sequential heads (see DecodeState)
  first: jax.Array         # [n] the first generated token
  drafts: jax.Array        # [n, Kd]
  draft_logq: jax.Array    # [n, Kd, V]
  draft_conf: jax.Array    # [n, Kd]
  key: jax.Array           # [n] the rows' PRNG keys for their decode steps


class Engine:
  """Compiled prefill / insert / generate for one model and one DecodeConfig.

  Greedy and sampling steps are two compiled variants of generate, chosen per call by whether
  any row samples or has a repetition penalty (the sampling variant handles greedy rows exactly,
  as one-hot distributions); both are compiled at warm-up, so sampling parameters never
  recompile.
  """

  def __init__(self, model_cfg: ModelConfig, heads_cfg: HeadsConfig, decode_cfg: DecodeConfig,
               eod_id: int, draft_model: tuple[ModelConfig, HeadsConfig] | None = None,
               mesh: jax.sharding.Mesh | None = None):
    """draft_model: the (model, heads) configs of the draft model when decode_cfg.drafter is
    'model'; params are then (target params, draft params). mesh: the decode state is sharded
    on it (slots on 'data', KV heads on 'model'; see sharding.py) and stays so across calls;
    params are expected on the same mesh (Decoder places them)."""
    self.model_cfg, self.heads_cfg = model_cfg, heads_cfg
    self.cfg = decode_cfg.resolve(model_cfg, heads_cfg)
    self.eod_id = eod_id
    self.graphdef, _ = model_lib.abstract(model_cfg, heads_cfg)
    self.drafter = self.cfg.drafter
    if (self.drafter == "model") != (draft_model is not None):
      raise ValueError("a draft model is needed exactly when decode.drafter='model'")
    self.draft_cfg = draft_model
    if draft_model is not None:
      if draft_model[0].vocab_size != model_cfg.vocab_size:
        raise ValueError(f"draft model vocab_size={draft_model[0].vocab_size} differs from the "
                         f"target's {model_cfg.vocab_size}")
      self.draft_graphdef, _ = model_lib.abstract(*draft_model)
    self.kd = self.cfg.k
    # Sequential heads draft through their own modules, each with a KV cache in the state.
    self.seq = heads_cfg.kind == "sequential" and self.drafter == "heads" and self.kd > 0
    self.n_mod = (1 if self.cfg.reuse_module else self.kd) if self.seq else 0
    # Seconds per step for k = 0..Kd; until calibrated, equal costs (the controller then only
    # weighs expected tokens).
    self.cost = [1.0] * (self.kd + 1)
    self.needs_conf = self.cfg.adaptive or self.cfg.confidence_threshold > 0
    self.dtype = model_lib.compute_dtype(model_cfg)
    # The trunk's (and a draft model's) KV cache: storage dtype, how attention reads it.
    self.cache_args = (kv.storage_dtype(self.cfg.kv_dtype, self.dtype), self.cfg.attention,
                       self.cfg.attention_block)
    self.mesh = mesh
    self.state_sharding = None
    if mesh is not None:
      from mtp_jax import sharding as sharding_lib
      self.state_sharding = sharding_lib.decode_state_shardings(
          jax.eval_shape(self._init_state_unplaced), mesh, self.cfg.batch_size)
    out = self.state_sharding
    self._prefill = jax.jit(self._prefill_impl, static_argnames=("sample",))
    self._insert = jax.jit(self._insert_impl, donate_argnames=("state",), out_shardings=out)
    self._generate = jax.jit(self._generate_impl, static_argnames=("sample", "ks"),
                             donate_argnames=("state",), out_shardings=out)
    self._cancel = jax.jit(lambda state, mask: state.replace(done=state.done | mask),
                           donate_argnums=0, out_shardings=out)
    # A fresh state in one compiled call, committed to its devices like every state the
    # compiled calls return (so that both hit the same executables); built op by op it cost
    # milliseconds of host time at the start of every run.
    self._init = jax.jit(self._init_state_unplaced, out_shardings=out if out is not None else
                         jax.sharding.SingleDeviceSharding(jax.devices()[0]))

  # ------------------------------------------------------------------ state

  def init_state(self, seed: int = 0) -> DecodeState:
    return self._init(jax.random.key(seed), np.asarray(self.cost, np.float32))

  def _init_state_unplaced(self, key=None, cost=None) -> DecodeState:
    """The state of an engine with no rows (key: the base PRNG key, default key(0); cost: the
    cost table, default self.cost)."""
    b, s, kd, v = self.cfg.batch_size, self.cfg.max_len, self.kd, self.model_cfg.vocab_size
    return DecodeState(
        tokens=jnp.zeros((b, s), jnp.int32), length=jnp.ones((b,), jnp.int32),
        prompt_len=jnp.ones((b,), jnp.int32), stop_len=jnp.ones((b,), jnp.int32),
        done=jnp.ones((b,), bool), drafts=jnp.zeros((b, kd), jnp.int32),
        draft_logq=jnp.zeros((b, kd, v), jnp.float32), draft_conf=jnp.zeros((b, kd), jnp.float32),
        n_fresh=jnp.zeros((b,), jnp.int32),
        cache=kv.init_cache(self.model_cfg, b, s, *self.cache_args),
        draft_cache=(kv.init_cache(self.draft_cfg[0], b, s, *self.cache_args)
                     if self.drafter == "model" else
                     self._seq_cache(b, s + kd + 1) if self.seq else None),
        seq_h=(jnp.zeros((b, self.n_mod, self.model_cfg.d_model), self.dtype) if self.seq
               else None),
        key=jax.random.split(jax.random.key(0) if key is None else key, b),
        temperature=jnp.zeros((b,), jnp.float32), top_k=jnp.zeros((b,), jnp.int32),
        top_p=jnp.ones((b,), jnp.float32), penalty=jnp.ones((b,), jnp.float32),
        ring=ring_lib.init_ring(self.cfg.ring_size, b, kd), step=jnp.zeros((), jnp.int32),
        row_steps=jnp.zeros((b,), jnp.int32), row_emitted=jnp.zeros((b,), jnp.int32),
        drafted=jnp.zeros((kd,), jnp.int32), accepted=jnp.zeros((kd,), jnp.int32),
        cond_trials=jnp.zeros((kd,), jnp.int32), cond_hits=jnp.zeros((kd,), jnp.int32),
        cond_weight=jnp.zeros((kd,), jnp.float32),
        pos_trials=jnp.zeros((adaptive.PROFILE_BUCKETS,), jnp.int32),
        pos_hits=jnp.zeros((adaptive.PROFILE_BUCKETS,), jnp.int32),
        row_hits=jnp.zeros((b, kd), jnp.float32), row_trials=jnp.zeros((b, kd), jnp.float32),
        cost=jnp.asarray(self.cost if cost is None else cost, jnp.float32),
        k_force=jnp.asarray(-1, jnp.int32),
        closed=jnp.asarray(False), probe_gap=jnp.asarray(self.cfg.probe_every, jnp.int32),
        plain_segs=jnp.zeros((), jnp.int32), seg_k=jnp.zeros((), jnp.int32),
        prior_rate=jnp.full((kd,), -1.0, jnp.float32),
        profile=jnp.ones((adaptive.PROFILE_BUCKETS,), jnp.float32))

  @staticmethod
  def put(state: DecodeState, **values) -> DecodeState:
    """state with fields set from host values, each placed as the field already is: an
    uncommitted array is another argument kind to the compiled calls, which would compile
    again for it (the whole generate program)."""
    return state.replace(**{
        name: jax.device_put(np.asarray(v, getattr(state, name).dtype),
                             getattr(state, name).sharding) for name, v in values.items()})

  def bucket(self, n: int) -> int:
    """The prefill bucket (a power of two >= min_bucket, at most max_len - k - 1) for n tokens."""
    cap = self.cfg.max_len - self.kd - 1
    if n > cap:
      raise ValueError(f"prompt of {n} tokens does not fit the context ({self.cfg.max_len} "
                       f"positions, {self.kd + 1} kept free for one step)")
    b = self.cfg.min_bucket
    while b < n:
      b *= 2
    return min(b, cap)

  def calibrate(self, params, table_path: str | None = None, force: bool = False) -> list[float]:
    """Sets the cost table c(k), k = 0..Kd: read from table_path (by device kind, model, slot
    count) unless `force`, else measured now and stored there."""
    path = table_path or adaptive.default_table_path()
    key = adaptive.table_key(self)
    cost = None if force else adaptive.load_table(path, key)
    if cost is None or len(cost) != self.kd + 1:
      self.cost = [1.0] * (self.kd + 1)        # every k compiled, for the measurement
      cost, info = adaptive.measure_costs(self, params)
      adaptive.save_table(path, key, cost, **info)
    self.cost = cost
    return cost

  @property
  def ks(self) -> tuple[int, ...] | None:
    """Adaptive k: the k the controller may choose under the cost table (adaptive.viable_ks),
    the step variants the adaptive loop compiles; None for a fixed-k engine."""
    if not self.cfg.adaptive:
      return None
    return adaptive.viable_ks(self.cost, self.cfg.adapt_margin)

  def buckets(self, max_prompt_len: int | None = None) -> list[int]:
    top = self.bucket(max_prompt_len or self.cfg.max_len - self.kd - 1)
    out, b = [], self.cfg.min_bucket
    while b < top:
      out.append(b)
      b *= 2
    return out + [top]

  def warmup(self, params, max_prompt_len: int | None = None) -> int:
    """Compiles every prefill bucket (greedy and sampled; 1 and prefill_rows rows), insert and
    both generate variants on a scratch state, so that serving compiles nothing.
    -> the number of buckets."""
    state = self.init_state()
    buckets = self.buckets(max_prompt_len)
    for n in sorted({1, self.cfg.prefill_rows}):
      for p in buckets:
        for t in (0.0, 1.0):
          # The same argument kinds as serving: one key per row, per-row lists.
          keys = jnp.stack([jax.random.key(0)] * n)
          prefix = self.prefill(params, [[0] * p] * n, keys, [t] * n, [0] * n, [1.0] * n,
                                [1.0] * n)
          state = self.insert(prefix, state, list(range(n)), [2] * n, [t] * n, [0] * n,
                              [1.0] * n, [1.0] * n)
    for sample in (False, True):
      state = self.generate(params, state, 1, sample=sample)
    state = self.cancel(state, np.zeros((self.cfg.batch_size,), bool))
    jax.block_until_ready(state)
    return len(buckets)

  def _seq_cache(self, b: int, s: int) -> kv.KVCache:
    """One cache layer per sequential module, indexed by the position of the module's input
    token (module i at trunk position t sits at t + i)."""
    return kv.init_cache(dataclasses.replace(self.model_cfg, n_layers=self.n_mod), b, s,
                         self.dtype)

  def _module(self, m, i: int):
    return m.heads.modules[0 if self.cfg.reuse_module else i]

  def _seq_update(self, m, h_BWD, tokens_BS, start_B, last_B, cache, seq_h, n_upd: int,
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
      h_prev, _, (ks[i], vs[i]) = self._module(m, i)(h_in, e, u, (ks[i], vs[i]),
                                                     key_min=i + 1)
      h_i = h_prev[rows, last_B]
      if active_B is not None:
        h_i = jnp.where(active_B[:, None], h_i, seq_h[:, i])
      new_h = new_h.at[:, i].set(h_i.astype(new_h.dtype))
    return kv.KVCache(k=tuple(ks), v=tuple(vs)), new_h

  def _draft_seq(self, m, seq_h, length_B, cache, key, sp, presence_BV, sample: bool,
                 n: int | None = None, want_conf: bool = True):
    """Drafts k tokens after a committed length L: draft 1 from module 1's output at its last
    committed position (seq_h[0], trunk position L-2); draft j from module j (or module 1 again
    with reuse_module) at input position L-2+j, fed the previous draft and the previous module's
    state. Its attention skips the module's entries not yet known to be right (past L-1), except
    with reuse_module, where the chain itself wrote them. n: drafts to make (default Kd)."""
    n = self.kd if n is None else n
    subs = sampling.split_rows(key, self.kd) if sample else None
    ks, vs = list(cache.k), list(cache.v)
    h = seq_h[:, 0]
    hn = self._module(m, 0).out_norm(h)
    drafts, logqs, confs = [], [], []
    limit = None if self.cfg.reuse_module else length_B - 1
    for j in range(n):
      if j > 0:
        layer = 0 if self.cfg.reuse_module else j
        u = (length_B - 1 + j)[:, None]
        e = m.trunk.embed(drafts[-1][:, None])
        hh, hn, (ks[layer], vs[layer]) = self._module(m, j)(
            h[:, None], e, u, (ks[layer], vs[layer]), limit, key_min=layer + 1)
        h, hn = hh[:, 0], hn[:, 0]
      d, logq, conf, presence_BV = self._pick(m.logits(hn), subs, j, sp, presence_BV, sample,
                                              j < self._conf_cols(n, want_conf))
      drafts.append(d)
      logqs.append(logq)
      confs.append(conf)
    return (jnp.stack(drafts, 1), jnp.stack(logqs, 1), jnp.stack(confs, 1),
            kv.KVCache(k=tuple(ks), v=tuple(vs)))

  def _bind(self, params):
    """-> (target model, draft model or None)."""
    if self.drafter == "model":
      return (model_lib.bind(self.graphdef, params[0]),
              model_lib.bind(self.draft_graphdef, params[1]))
    return model_lib.bind(self.graphdef, params), None

  # ------------------------------------------------------------------ drafting

  def _draft_from(self, m, dm, h_BD, tokens_BS, length_B, draft_cache, key, sp, presence_BV,
                  sample: bool, n: int | None = None, want_conf: bool = True):
    """n (default Kd) drafts for the next step from the configured drafter (prompt lookup
    always makes Kd: they cost nothing); the row's committed tokens are tokens_BS[:, :length_B].
    -> (drafts [B, n], logq, conf, draft_cache)."""
    n = self.kd if n is None else n
    if self.drafter == "heads" or self.kd == 0:
      return self._draft(m, h_BD, key, sp, presence_BV, sample, n, want_conf) + (draft_cache,)
    if self.drafter == "ngram":
      return self._draft_ngram(tokens_BS, length_B, sample) + (draft_cache,)
    return self._draft_model(dm, tokens_BS, length_B, draft_cache, key, sp, presence_BV, sample,
                             n, want_conf)

  def _draft_ngram(self, tokens_BS, length_B, sample: bool):
    """Prompt lookup: find the latest earlier occurrence of the row's last n tokens in its
    history and propose the Kd tokens that followed it. The drafts are deterministic (q is one-hot
    on them), so sampling verification stays exact. conf is 1 where a match was found, else 0."""
    n, kd, v = self.cfg.ngram_n, self.kd, self.model_cfg.vocab_size
    b, s = tokens_BS.shape
    last = jnp.take_along_axis(tokens_BS, jnp.maximum(length_B - n, 0)[:, None] + jnp.arange(n),
                               axis=1)                                  # [B, n]
    w = s - n
    eq = jnp.ones((b, w), bool)
    for i in range(n):
      eq &= tokens_BS[:, i: i + w] == last[:, i: i + 1]
    j = jnp.arange(w)[None]
    ok = eq & (j < (length_B - n)[:, None])          # the match ends before the suffix itself
    found = jnp.any(ok, 1) & (length_B > n)
    best = jnp.max(jnp.where(ok, j, -1), 1)
    idx = jnp.clip(best[:, None] + n + jnp.arange(kd)[None], 0, s - 1)
    drafts = jnp.take_along_axis(tokens_BS, idx, axis=1)
    conf = jnp.broadcast_to(found[:, None], (b, kd)).astype(jnp.float32)
    logq = (jnp.where(jnp.arange(v) == drafts[..., None], 0.0, sampling.NEG_INF)
            if sample else jnp.zeros((b, kd, v), jnp.float32))
    return drafts, logq, conf

  def _conf_cols(self, n: int, want_conf: bool = True) -> int:
    """How many of n greedy drafts need a confidence: all of them for the threshold's cut; only
    the first for the controller alone (it reads later positions off the ring), and only where
    it may read them (want_conf: in the adaptive loop, drafting steps and a probe); none
    otherwise."""
    if self.cfg.confidence_threshold > 0:
      return n
    return min(n, 1) if self.needs_conf and want_conf else 0

  def _pick(self, logits_BV, subs, i: int, sp, presence_BV, sample: bool, want_conf: bool):
    """One draft of an autoregressive drafter (draft model, sequential heads) from its logits:
    sampled from the processed distribution (the drafts so far join the penalty's history),
    or the argmax. -> (draft, logq (zeros when greedy), confidence, presence)."""
    b, v = logits_BV.shape
    if sample:
      logq = sampling.process_logits(logits_BV, *sp, presence_BV)
      d = sampling.sample(subs[:, i], logq)
      return d, logq, jnp.exp(jnp.max(logq, -1)), presence_BV.at[jnp.arange(b), d].set(True)
    conf = peak_prob(logits_BV) if want_conf else jnp.zeros((b,), jnp.float32)
    return (jnp.argmax(logits_BV, -1).astype(jnp.int32), jnp.zeros((b, v), jnp.float32), conf,
            presence_BV)

  def _draft_model(self, dm, tokens_BS, length_B, cache, key, sp, presence_BV, sample: bool,
                   n: int, want_conf: bool = True):
    """Classic speculative decoding's drafter: the draft model (its own KV cache) runs the last
    two committed tokens (positions L-2, L-1: the one before may be a draft it never saw), then
    one token per further draft."""
    pos = (length_B - 2)[:, None] + jnp.arange(2)[None]
    inp = jnp.take_along_axis(tokens_BS, pos, axis=1)
    h, cache = dm(inp, pos, cache)
    logits = dm.logits(h[:, -1])
    subs = sampling.split_rows(key, self.kd)
    drafts, logqs, confs = [], [], []
    for i in range(n):
      d, logq, conf, presence_BV = self._pick(logits, subs, i, sp, presence_BV, sample,
                                              i < self._conf_cols(n, want_conf))
      drafts.append(d)
      logqs.append(logq)
      confs.append(conf)
      if i + 1 < n:
        p1 = (length_B + i)[:, None]
        h, cache = dm(d[:, None], p1, cache)
        logits = dm.logits(h[:, 0])
    return jnp.stack(drafts, 1), jnp.stack(logqs, 1), jnp.stack(confs, 1), cache

  def _draft(self, m, h_BD, key, sp, presence_BV, sample: bool, n: int | None = None,
             want_conf: bool = True):
    """n (default Kd) drafts from the first n heads at one hidden state per row
    -> (drafts [B, n], logq [B, n, V], the heads' confidence: peak probability [B, n]).

    When sampling, draft i is drawn from head i's processed distribution, whose repetition
    penalty also counts drafts 1..i-1 (the history the trunk will verify it against).
    """
    b, v = h_BD.shape[0], self.model_cfg.vocab_size
    n = self.kd if n is None else n
    if n == 0:
      return (jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0, v), jnp.float32),
              jnp.zeros((b, 0), jnp.float32))
    hh = m.head_hidden(h_BD[:, None], n=n)[:, 0]                        # [B, n, D]
    logits = m.logits(hh)                                               # [B, n, V]
    if not sample:
      # Confidences feed only the controller and the threshold: the softmax is skipped where
      # neither reads it.
      c = self._conf_cols(n, want_conf)
      conf_BN = jnp.zeros((b, n), jnp.float32)
      if c:
        conf_BN = conf_BN.at[:, :c].set(peak_prob(logits[:, :c]))
      return (jnp.argmax(logits, -1).astype(jnp.int32), jnp.zeros((b, n, v), jnp.float32),
              conf_BN)
    drafts, logqs = [], []
    subs = sampling.split_rows(key, self.kd)                            # [B, Kd] row keys
    for i in range(n):
      logq = sampling.process_logits(logits[:, i], *sp, presence_BV)
      d = sampling.sample(subs[:, i], logq)
      presence_BV = presence_BV.at[jnp.arange(b), d].set(True)
      drafts.append(d)
      logqs.append(logq)
    drafts, logq = jnp.stack(drafts, 1), jnp.stack(logqs, 1)
    # The confidence is the peak of the head's distribution, not q(d_i): a cut that depended on
    # the sampled draft itself would bias the output (rejection sampling assumes d_i ~ q_i).
    return drafts, logq, jnp.exp(jnp.max(logq, -1))

  # ------------------------------------------------------------------ prefill / insert

  def _prefill_impl(self, params, tokens_NP, length_N, key, temperature, top_k, top_p, penalty,
                    sample: bool):
    m, dm = self._bind(params)
    n, p = tokens_NP.shape
    cache = kv.init_cache(self.model_cfg, n, p, *self.cache_args)
    h, cache = m(tokens_NP, jnp.broadcast_to(jnp.arange(p), (n, p)), cache)
    dcache = None
    if dm is not None:       # room for the first token and the drafts after the prompt
      dcache = kv.init_cache(self.draft_cfg[0], n, p + self.kd + 1, *self.cache_args)
      _, dcache = dm(tokens_NP, jnp.broadcast_to(jnp.arange(p), (n, p)), dcache)
    h_last = jnp.take_along_axis(h, (length_N - 1)[:, None, None], axis=1)[:, 0]
    logits = m.logits(h_last)
    ks = sampling.split_rows(key, 3)
    k_first, k_draft, key = ks[:, 0], ks[:, 1], ks[:, 2]
    sp = (temperature, top_k, top_p, penalty)
    presence = None
    if sample:
      presence = sampling.presence(tokens_NP, length_N, self.model_cfg.vocab_size)
      first = sampling.sample(k_first, sampling.process_logits(logits, *sp, presence))
      presence = presence.at[jnp.arange(n), first].set(True)
    else:
      first = jnp.argmax(logits, -1).astype(jnp.int32)
    hist = None
    if self.drafter != "heads" or self.seq:   # these drafters read the tokens, first included
      hist = jnp.zeros((n, p + self.kd + 1), jnp.int32).at[:, :p].set(tokens_NP)
      hist = hist.at[jnp.arange(n), length_N].set(first)
    seq_h = None
    if self.seq:
      # Every module over the whole prompt (trunk positions 0..P-1, input positions i..P-1+i);
      # module i's last committed trunk position is L-1-i = length - i.
      dcache = self._seq_cache(n, p + self.kd + 1)
      seq_h = jnp.zeros((n, self.n_mod, self.model_cfg.d_model), self.dtype)
      ks, vs, hp = list(dcache.k), list(dcache.v), h
      pos = jnp.arange(p)[None]
      for i in range(self.n_mod):
        u = jnp.broadcast_to(pos + i + 1, (n, p))
        e = m.trunk.embed(hist[:, i + 1: i + 1 + p])
        hp, _, (ks[i], vs[i]) = self._module(m, i)(hp, e, u, (ks[i], vs[i]), key_min=i + 1)
        at = jnp.maximum(length_N - i - 1, 0)
        seq_h = seq_h.at[:, i].set(hp[jnp.arange(n), at].astype(seq_h.dtype))
      dcache = kv.KVCache(k=tuple(ks), v=tuple(vs))
      drafts, logq, conf, dcache = self._draft_seq(m, seq_h, length_N + 1, dcache, k_draft, sp,
                                                   presence, sample)
    else:
      drafts, logq, conf, dcache = self._draft_from(m, dm, h_last, hist, length_N + 1, dcache,
                                                    k_draft, sp, presence, sample)
    return Prefix(tokens=tokens_NP, length=length_N, cache=cache, draft_cache=dcache,
                  seq_h=seq_h, first=first, drafts=drafts, draft_logq=logq, draft_conf=conf,
                  key=key)

  def prefill(self, params, prompts: list[list[int]], key, temperature, top_k, top_p,
              penalty=None) -> Prefix:
    """Prefills prompts (token ids) padded to the bucket of the longest one. `key` is one PRNG
    key, or one per prompt (a row's sampled tokens then depend on its key alone)."""
    lengths = [len(p) for p in prompts]
    if min(lengths) < 1:
      raise ValueError("empty prompt: a prompt needs at least one token")
    p = self.bucket(max(lengths))
    arr = np.zeros((len(prompts), p), np.int32)
    for i, ids in enumerate(prompts):
      arr[i, : len(ids)] = ids
    temperature = np.asarray(temperature, np.float32)
    penalty = np.ones_like(temperature) if penalty is None else np.asarray(penalty, np.float32)
    key = sampling.row_keys(key, len(prompts))
    return self._prefill(params, jnp.asarray(arr), jnp.asarray(lengths, jnp.int32), key,
                         jnp.asarray(temperature), jnp.asarray(top_k, jnp.int32),
                         jnp.asarray(top_p, jnp.float32), jnp.asarray(penalty),
                         sample=needs_sampling(temperature, penalty))

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slots, max_new, temperature, top_k,
                   top_p, penalty):
    n, p = prefix.tokens.shape
    s = self.cfg.max_len
    rows = slots[:, None]

    def put(cache, rows_cache):    # the prefix's positions 0..P'-1 into the slots' rows
      cols = jnp.arange(rows_cache.max_len)[None, :]
      # Over the whole pytree, so that a quantised cache's scales travel along.
      return jax.tree.map(lambda c, pc: c.at[rows, cols].set(pc.astype(c.dtype)), cache,
                          rows_cache)

    dcache = (None if state.draft_cache is None
              else put(state.draft_cache, prefix.draft_cache))
    row_tokens = jnp.zeros((n, s), jnp.int32).at[:, :p].set(prefix.tokens)
    row_tokens = jnp.where(jnp.arange(s)[None] < prefix.length[:, None], row_tokens, 0)
    row_tokens = row_tokens.at[jnp.arange(n), prefix.length].set(prefix.first)
    length = prefix.length + 1
    stop_len = jnp.minimum(prefix.length + max_new, s - self.kd - 1)
    done = (length >= stop_len) | (prefix.first == self.eod_id)
    z = jnp.zeros((n,), jnp.int32)
    return state.replace(
        tokens=state.tokens.at[slots].set(row_tokens), length=state.length.at[slots].set(length),
        prompt_len=state.prompt_len.at[slots].set(prefix.length),
        stop_len=state.stop_len.at[slots].set(stop_len), done=state.done.at[slots].set(done),
        drafts=state.drafts.at[slots].set(prefix.drafts),
        draft_logq=state.draft_logq.at[slots].set(prefix.draft_logq),
        draft_conf=state.draft_conf.at[slots].set(prefix.draft_conf),
        n_fresh=state.n_fresh.at[slots].set(self.kd),
        cache=put(state.cache, prefix.cache), draft_cache=dcache,
        seq_h=None if state.seq_h is None else state.seq_h.at[slots].set(prefix.seq_h),
        key=state.key.at[slots].set(prefix.key),
        temperature=state.temperature.at[slots].set(temperature),
        top_k=state.top_k.at[slots].set(top_k), top_p=state.top_p.at[slots].set(top_p),
        penalty=state.penalty.at[slots].set(penalty), row_steps=state.row_steps.at[slots].set(z),
        row_emitted=state.row_emitted.at[slots].set(z),
        row_hits=state.row_hits.at[slots].set(0.0), row_trials=state.row_trials.at[slots].set(0.0))

  def insert(self, prefix: Prefix, state: DecodeState, slots, max_new, temperature, top_k,
             top_p, penalty=1.0) -> DecodeState:
    """Puts prefilled rows into slots (state donated). max_new counts the first token. A slot
    index >= batch_size drops its row (padding rows of a prefill call)."""
    f = lambda x, d: jnp.asarray(np.broadcast_to(np.asarray(x), (len(slots),)), d)
    return self._insert(prefix, state, f(slots, jnp.int32), f(max_new, jnp.int32),
                        f(temperature, jnp.float32), f(top_k, jnp.int32), f(top_p, jnp.float32),
                        f(penalty, jnp.float32))

  def cancel(self, state: DecodeState, mask) -> DecodeState:
    """Marks the rows where mask [B] is true as done (state donated): a row the host finished,
    e.g. on a stop string, stops using the device."""
    return self._cancel(state, jnp.asarray(np.asarray(mask, bool)))

  # ------------------------------------------------------------------ the step

  def step(self, m, state: DecodeState, k: int, sample: bool, n_draft: int | None = None,
           dm=None, want_conf: bool = True) -> DecodeState:
    """One draft-and-verify step with k drafts (static), for all rows, its K/V written into the
    cache. With a confidence threshold, a row verifies only its drafts before the first one its
    head doubts; a row never verifies more than its fresh drafts (n_fresh).

    n_draft (default Kd): drafts to make for the next step. The adaptive loop drafts only what
    the next step of the same k may verify (none in a plain segment, so that choosing k = 0
    costs what plain decoding costs; one head in the last two steps of a probe segment); the
    drafts not made keep their old values with zero confidence and are not fresh. want_conf: the
    controller reads this step's draft confidences (see _conf_cols).
    """
    nd = self.kd if n_draft is None else n_draft
    length = state.length
    last = jnp.take_along_axis(state.tokens, (length - 1)[:, None], axis=1)
    drafts = state.drafts[:, :k]
    k_row = jnp.minimum(self.row_limit(state), k)
    inp = jnp.concatenate([last, drafts], axis=1)                       # [B, k+1]
    pos = (length - 1)[:, None] + jnp.arange(k + 1)[None]
    h, cache = m(inp, pos, state.cache)
    logits = m.logits(h)                                                # [B, k+1, V]
    ks = sampling.split_rows(state.key, 3)                              # per-row streams
    key, k_verify, k_draft = ks[:, 0], ks[:, 1], ks[:, 2]
    sp = (state.temperature, state.top_k, state.top_p, state.penalty)
    v = self.model_cfg.vocab_size
    # Rows verify only their fresh drafts (n_fresh, and the threshold's cut): a stale draft was
    # proposed for another position. A fixed engine without a threshold has all k fresh in
    # every row (k_row == k), so it skips the masks.
    cut = k_row if self.cfg.confidence_threshold > 0 or self.cfg.adaptive else None
    if sample:
      # Position j is verified against the history plus drafts 1..j.
      base = sampling.presence(state.tokens, length, v)
      seen = jnp.cumsum(jax.nn.one_hot(drafts, v, dtype=jnp.int32), axis=1) > 0   # [B, k, V]
      pres = jnp.concatenate([base[:, None], base[:, None] | seen], axis=1)      # [B, k+1, V]
      logp = sampling.process_logits(logits, *sp, pres)
      n, out = sampling.verify_sampling(k_verify, drafts, state.draft_logq[:, :k], logp, cut)
    else:
      n, out = sampling.verify_greedy(drafts, logits, cut)
    active = ~state.done
    idx = jnp.arange(k + 1)[None]
    eod_at = jnp.min(jnp.where(out == self.eod_id, idx, k + 1), axis=1)
    n_emit = jnp.minimum(jnp.minimum(n + 1, eod_at + 1), state.stop_len - length)
    n_emit = jnp.where(active, n_emit, 0)
    write = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))
    tokens = jnp.where(active[:, None], write(state.tokens, out, length), state.tokens)
    new_length = length + n_emit
    done = state.done | (new_length >= state.stop_len) | (active & (eod_at < n_emit))
    h_last = jnp.take_along_axis(h, n[:, None, None], axis=1)[:, 0]
    new_pres = None
    if sample:   # the history grows by the emitted tokens only: no second scan of the buffer
      b = length.shape[0]
      emitted = jnp.arange(k + 1)[None] < n_emit[:, None]
      new_pres = base.at[jnp.arange(b)[:, None], out].max(emitted)
    dcache, seq_h = state.draft_cache, state.seq_h
    if nd and self.seq:
      # The modules' caches take the committed tokens (this step's accepted positions), in the
      # same compiled step, then the modules draft in sequence.
      n_upd = min(k, self.n_mod) if k > 0 else 0
      if n_upd:
        dcache, seq_h = self._seq_update(m, h, tokens, length, n, dcache, seq_h, n_upd, active)
      new_drafts, logq, conf, dcache = self._draft_seq(m, seq_h, new_length, dcache, k_draft, sp,
                                                       new_pres, sample, nd, want_conf)
    elif nd:
      new_drafts, logq, conf, dcache = self._draft_from(m, dm, h_last, tokens, new_length, dcache,
                                                        k_draft, sp, new_pres, sample, nd,
                                                        want_conf)
    else:
      new_drafts = jnp.zeros((length.shape[0], 0), jnp.int32)
      logq, conf = jnp.zeros((length.shape[0], 0, v), jnp.float32), jnp.zeros((length.shape[0], 0))
    made = new_drafts.shape[1]
    if not sample:
      # Only sampled verification reads q, and a row that samples runs sampled steps only
      # (greedy rows verify exactly against any q): greedy steps leave draft_logq as it is.
      logq = state.draft_logq
    if made < self.kd:     # the drafts not made keep their old values, with zero confidence
      new_drafts = jnp.concatenate([new_drafts, state.drafts[:, made:]], 1)
      if sample:
        logq = jnp.concatenate([logq.astype(jnp.float32), state.draft_logq[:, made:]], 1)
      conf = jnp.concatenate([conf, jnp.zeros_like(state.draft_conf[:, made:])], 1)
    n_active = jnp.sum(active.astype(jnp.int32))
    verified = jnp.where(active, k_row, 0)
    pos_k = jnp.arange(self.kd)[None]
    drafted = state.drafted + jnp.sum((pos_k < verified[:, None]).astype(jnp.int32), 0)
    accepted = state.accepted + jnp.sum(
        (active[:, None] & (n[:, None] > pos_k)).astype(jnp.int32), 0)
    # Reached: verified there, every draft before it accepted; an adaptive engine does not
    # count a row's warm-up steps (adaptive.row_window).
    reached = (pos_k < verified[:, None]) & (n[:, None] >= pos_k)              # [B, Kd]
    if self.cfg.adaptive:
      reached = reached & (state.row_steps >= self.cfg.adapt_warmup)[:, None]
    hit = reached & (n[:, None] > pos_k)
    cond_trials = state.cond_trials + jnp.sum(reached.astype(jnp.int32), 0)
    cond_hits = state.cond_hits + jnp.sum(hit.astype(jnp.int32), 0)
    # Output position: trials weigh g there (a level), and the first position's counts go to
    # its bucket (the next run's profile). The same per row, decaying. Only the controller and
    # the next run's prior read them: a fixed-k engine carries them unchanged.
    out_pos = state.length - state.prompt_len
    cond_weight, pos_trials, pos_hits = state.cond_weight, state.pos_trials, state.pos_hits
    row_hits, row_trials = state.row_hits, state.row_trials
    if self.cfg.adaptive:
      g = adaptive.profile_weight(state.profile, out_pos)[:, None]                # [B, 1]
      cond_weight = cond_weight + jnp.sum(reached.astype(jnp.float32) * g, 0)
      if self.kd:
        bucket = adaptive.profile_bucket(out_pos)
        pos_trials = pos_trials.at[bucket].add(reached[:, 0].astype(jnp.int32))
        pos_hits = pos_hits.at[bucket].add(hit[:, 0].astype(jnp.int32))
      decay = 1.0 - 1.0 / adaptive.ROW_MEMORY_STEPS
      row_hits = row_hits * decay + hit.astype(jnp.float32)
      row_trials = row_trials * decay + reached.astype(jnp.float32) * g
    ring = ring_lib.record(state.ring, state.step, out, n_emit, verified, jnp.where(active, n, 0),
                           k, n_active, state.row_steps, out_pos)
    return state.replace(
        tokens=tokens, length=new_length, done=done, drafts=new_drafts, draft_logq=logq,
        draft_conf=conf, n_fresh=jnp.full_like(state.n_fresh, made), cache=cache,
        draft_cache=dcache, seq_h=seq_h, key=key, ring=ring,
        step=state.step + 1,
        row_steps=state.row_steps + active.astype(jnp.int32),
        row_emitted=state.row_emitted + n_emit, drafted=drafted,
        accepted=accepted, cond_trials=cond_trials, cond_hits=cond_hits,
        cond_weight=cond_weight, pos_trials=pos_trials, pos_hits=pos_hits,
        row_hits=row_hits, row_trials=row_trials)

  def row_limit(self, state: DecodeState):
    """Per row, the drafts it may verify: its fresh drafts, cut before the first one whose
    confidence is below the threshold."""
    conf_BK = state.draft_conf
    if self.cfg.confidence_threshold <= 0 or self.kd == 0:
      return state.n_fresh
    low = conf_BK < self.cfg.confidence_threshold
    cut = jnp.where(jnp.any(low, 1), jnp.argmax(low, 1), self.kd).astype(jnp.int32)
    return jnp.minimum(cut, state.n_fresh)

  def controller_limit(self, state: DecodeState):
    """Per row, the drafts the controller may expect it to verify: none without a fresh draft
    (a plain step drafts nothing), the threshold's cut where it falls within the fresh drafts,
    else all Kd: a probe drafts only the first head, and the positions past it are estimated
    from the ring's rates and the prior (row_alpha), as for any position that has no draft yet."""
    lim = self.row_limit(state)
    return jnp.where((state.n_fresh > 0) & (lim >= state.n_fresh), self.kd, lim).astype(jnp.int32)

  def choose_k(self, state: DecodeState, ks: tuple[int, ...] | None = None):
    """The controller: k for the next step, on the device (see adaptive.py), one of ks
    (default self.ks); a forced k (k_force) becomes the largest of ks not above it."""
    ks = self.ks if ks is None else ks
    allowed = jnp.isin(jnp.arange(self.kd + 1), jnp.asarray(ks))
    # Every count is a level (weighed by the profile where it was made); the estimate for the
    # steps ahead is the level times g there: at the row's output position for the next step,
    # the mean over its tokens still to come once none waits (adaptive.future_gain).
    hits_b, trials_b = adaptive.row_window(state.ring, state.step, self.cfg.accept_window,
                                           self.kd, self.cfg.adapt_warmup, state.profile)
    rate, trials = adaptive.other_rows_rates(hits_b, trials_b)
    # A row's own counts: the window's at the first position, which every drafting step tries;
    # past it, the longer memory (row_hits / row_trials), since those positions get trials only
    # while the controller drafts that far: forgetting them after accept_window steps sent it
    # back to drafting that far every few segments, at the cost of a wasted segment each time.
    # Once none waits, what counts is when the last rows finish, and a row lags because it
    # drafted worse, also longer ago than the window: the memory then serves the first position
    # too (with the window there, the controller took the rows that lagged at 256 slots for
    # average ones and drafted the last 30-40 steps of a job, at a loss).
    first_hits = jnp.where(state.closed, state.row_hits[:, :1], hits_b[:, :1])
    first_trials = jnp.where(state.closed, state.row_trials[:, :1], trials_b[:, :1])
    own_hits = jnp.concatenate([first_hits, state.row_hits[:, 1:]], 1)
    own_trials = jnp.concatenate([first_trials, state.row_trials[:, 1:]], 1)
    remaining = state.stop_len - state.length
    out_pos = state.length - state.prompt_len
    g_now = adaptive.profile_weight(state.profile, out_pos)
    gain = jnp.where(state.closed, adaptive.future_gain(state.profile, out_pos, remaining), g_now)
    # A row without a fresh draft is expected to accept nothing (controller_limit).
    alpha = adaptive.row_alpha(rate, trials, state.draft_conf / g_now[:, None],
                               self.controller_limit(state), own_hits, own_trials,
                               state.prior_rate, gain)
    active = ~state.done
    margin = self.cfg.adapt_margin
    k = jnp.where(state.closed,
                  adaptive.choose_k_to_finish(
                      state.cost, alpha, active, remaining, margin, allowed,
                      adaptive.finish_sd(alpha, own_trials, remaining)),
                  adaptive.choose_k(state.cost, adaptive.expected_emitted(alpha, active), margin,
                                    allowed))
    forced = jnp.max(jnp.where(allowed & (jnp.arange(self.kd + 1) <= state.k_force),
                               jnp.arange(self.kd + 1), 0))
    return jnp.where(state.k_force >= 0, forced, k).astype(jnp.int32)

  def _generate_impl(self, params, state: DecodeState, num_steps, refill, sample: bool,
                     ks: tuple[int, ...] | None = None):
    m, dm = self._bind(params)
    # With refill > 0 (requests wait for slots), the call ends after the step in which the
    # refill-th row finishes, so that the host refills the slots then rather than at the end of
    # the chunk.
    done0 = state.done
    freed = lambda st: jnp.sum((st.done & ~done0).astype(jnp.int32))
    not_done = lambda st: ~jnp.all(st.done) & ((refill == 0) | (freed(st) < refill))

    def steps(j, i, st, k, nd, go, want_conf=True):
      """Steps of k drafts (nd made) while go(j) and the call goes on; j counts them on top of
      the caller's j, i the call's steps. -> (j, i, st)."""
      def run(c):
        return go(c[0]) & (c[1] < num_steps) & not_done(c[2])

      def body(c):
        return c[0] + 1, c[1] + 1, self.step(m, c[2], k, sample, nd, dm=dm, want_conf=want_conf)
      return jax.lax.while_loop(run, body, (j, i, st))

    zero = jnp.zeros((), jnp.int32)
    if not self.cfg.adaptive:
      return steps(zero, zero, state, self.kd, None, lambda j: True)[2]
    kmax = max(ks)
    if kmax == 0:    # no k can pay under the cost table (adaptive.viable_ks): plain decoding
      return steps(zero, zero, state, 0, 0, lambda j: True)[2]

    # Adaptive k: the controller chooses k at the start of each segment of adapt_every steps
    # (segments run across calls: step counts them). A drafting step drafts its own k and the
    # first draft's confidence (what the controller reads); where the controller raises k, the
    # first step of the larger k verifies the drafts there are (n_fresh), and the controller
    # estimates the positions past a row's fresh drafts from the rates and the prior
    # (controller_limit). A plain segment drafts nothing, except a probe segment: its
    # second-to-last step drafts one head, and its last step verifies that draft (a step of one
    # draft) and drafts one head again, so that the controller sees real acceptance in the
    # window and fresh confidences when acceptance may have recovered (with adapt_every=1 a probe
    # is that one step, which has nothing to verify and drafts one head). (Confidences alone keep
    # a controller that began plain there: the heads' peak probability understates how often
    # their drafts are accepted, and nothing else would ever be verified.) Probes come every
    # probe_gap plain segments; the gap doubles after each probe that leads to no drafting (up
    # to probe_every_max), since a probe costs head work and a step of one draft; after a
    # drafting segment it is accept_window steps (in segments): the turn to plain decoding is
    # checked again once the rates that made it have left the window.
    #
    # A call runs top-level loops, in order, each step a fixed-k engine's own step:
    # 1. one loop per drafting k of ks, the largest first, each running while the controller
    #    keeps to its k (checked by a lax.cond where a segment ends);
    # 2. plain segments up to the start of the next probe segment: with no fresh drafts the
    #    controller can only choose 0 again;
    # 3. the probe loop: probe segments (plain steps, the last two drafting one head, the last
    #    one verifying a draft), while the controller keeps to plain decoding; it stops where a
    #    drafting segment or a plain run would begin;
    # 4. that plain run, as in 2.
    # The call ends where the controller raises k past the loops already run (the next call
    # begins at loop 1). Why loops: a lax.switch over variants gives each branch a copy of
    # every buffer it updates (the whole KV cache, every step); a while_loop updates its carry
    # in place. Why at the top level: nested in a segment loop, the same steps ran 4-8% slower
    # on XLA:CPU.
    every = self.cfg.adapt_every
    after_drafting = min(-(-self.cfg.accept_window // every), self.cfg.probe_every_max)

    def choose(st):
      """The k of the segment st.step begins, or continues: a call that begins inside a
      drafting segment continues it (k is chosen once per segment; inside a plain segment it
      chooses again: rows inserted since bring fresh drafts)."""
      cont = ((st.step % every > 0) & (st.seg_k > 0) & (st.k_force < 0)
              & jnp.isin(st.seg_k, jnp.asarray(ks)))
      return jnp.where(cont, st.seg_k, self.choose_k(st, ks))

    def steady(k):
      k_ = jnp.asarray(k, jnp.int32)

      def body(c):
        i, _, st = c
        st = self.step(m, st, k, sample, k, dm=dm, want_conf=True)
        nk = jax.lax.cond(st.step % every == 0, lambda s: self.choose_k(s, ks), lambda s: k_, st)
        return i + 1, nk, st
      return body

    # kc: the k the call goes on with (what choose() gives for the state reached).
    i, kc, st, seg = zero, choose(state), state, state.seg_k
    for k in sorted(ks[1:], reverse=True):
      i0 = i
      i, kc, st = jax.lax.while_loop(
          lambda c, k=k: (c[1] == k) & (c[0] < num_steps) & not_done(c[2]), steady(k),
          (i, kc, st))
      seg = jnp.where(i > i0, k, seg)
    ran = i > 0
    st = st.replace(probe_gap=jnp.where(ran, after_drafting, st.probe_gap),
                    plain_segs=jnp.where(ran, 0, st.plain_segs), seg_k=seg)

    def plain(i, k, st):
      """Plain segments that do not probe draft nothing, and with no fresh drafts the
      controller can only choose 0 again: where k is 0 they run in one top-level loop up to the
      start of the probe segment (a k forced to plain decoding, as when the cost table is
      measured: to the end of the call). -> (i, st)"""
      phase = st.step % every
      forced = st.k_force >= 0
      run = (k == 0) & (forced | (st.plain_segs + 1 < st.probe_gap))
      n_run = jnp.where(forced, num_steps - i, every * (st.probe_gap - 1 - st.plain_segs) - phase)
      j, i, st = steps(zero, i, st, 0, 0, lambda j: run & (j < n_run), want_conf=False)
      return i, st.replace(plain_segs=st.plain_segs + (phase + j) // every,
                           seg_k=jnp.where(j > 0, 0, st.seg_k))

    # Only the call's start and the drafting loops choose (inserted rows bring fresh drafts).
    i, st = plain(i, kc, st)

    def probe_segment(carry):
      i, _, st = carry
      phase = st.step % every
      k = choose(st)
      probe = (k == 0) & (st.plain_segs + 1 >= st.probe_gap) & (st.k_force < 0)
      n_run = every - phase                      # steps to the end of the segment
      j, i, st = steps(zero, i, st, 0, 0, lambda j: probe & (j < n_run - 2), want_conf=False)
      j, i, st = steps(j, i, st, 0, 1, lambda j: probe & (j < n_run - 1), want_conf=False)
      j, i, st = steps(j, i, st, 1, 1, lambda j: probe & (j < n_run), want_conf=True)
      ended = (phase + j) // every               # segments completed
      gap = jnp.minimum(2 * st.probe_gap, self.cfg.probe_every_max)
      return i, jnp.where(probe, -1, k), st.replace(
          probe_gap=jnp.where(ended > 0, gap, st.probe_gap),
          plain_segs=jnp.where(ended > 0, 0, st.plain_segs),
          seg_k=jnp.where(probe, 0, st.seg_k))

    # The probe loop's carry: (i, the k it stopped at (-1: none yet), st).
    i, k_stop, st = jax.lax.while_loop(
        lambda c: (c[1] < 0) & (c[0] < num_steps) & not_done(c[2]), probe_segment,
        (i, jnp.asarray(-1, jnp.int32), st))
    # Where it stopped at a plain run (after a probe that found nothing worth drafting), the
    # run follows in this call, up to the next probe: otherwise every probe would end its call.
    return plain(i, k_stop, st)[1]

  def generate(self, params, state: DecodeState, num_steps: int | None = None,
               sample: bool | None = None, refill: int = 0) -> DecodeState:
    """Runs up to num_steps (<= ring capacity) steps; `state` is donated. refill > 0: stop
    after the step in which the refill-th row finishes (requests wait for slots); not a
    compiled variant."""
    num_steps = self.cfg.ring_size if num_steps is None else num_steps
    if not 0 < num_steps <= self.cfg.ring_size:
      raise ValueError(f"num_steps={num_steps} must be in 1..ring_size={self.cfg.ring_size}")
    if sample is None:
      sample = needs_sampling(np.asarray(state.temperature), np.asarray(state.penalty))
    return self._generate(params, state, jnp.asarray(num_steps, jnp.int32),
                          jnp.asarray(refill, jnp.int32), sample=sample, ks=self.ks)


def peak_prob(logits_XV):
  """The largest probability of softmax(logits) over the last axis, 1 / sum(exp(l - max l)):
  one pass of exp, no normalised distribution."""
  x = logits_XV.astype(jnp.float32)
  return 1.0 / jnp.sum(jnp.exp(x - jnp.max(x, -1, keepdims=True)), -1)


def tree_bytes(tree) -> int:
  """Bytes of a pytree of arrays or shapes (PRNG keys, a few bytes each, are left out)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
                 if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)))


def state_bytes(model_cfg: ModelConfig, heads_cfg: HeadsConfig, decode_cfg: DecodeConfig,
                draft_model=None) -> int:
  """Bytes of the decode state (KV caches, token buffer, drafts, ring, ...) for decode_cfg."""
  eng = Engine(model_cfg, heads_cfg, decode_cfg, 0, draft_model)
  return tree_bytes(jax.eval_shape(eng.init_state))


def max_slots(model_cfg: ModelConfig, heads_cfg: HeadsConfig, decode_cfg: DecodeConfig,
              budget_bytes: int) -> int:
  """The largest slot count whose decode state fits budget_bytes (at least 1)."""
  one = state_bytes(model_cfg, heads_cfg, dataclasses.replace(decode_cfg, batch_size=1))
  two = state_bytes(model_cfg, heads_cfg, dataclasses.replace(decode_cfg, batch_size=2))
  per_slot, fixed = two - one, 2 * one - two
  return max(1, int((budget_bytes - fixed) // per_slot))


def needs_sampling(temperature, penalty) -> bool:
  """Whether rows with these parameters need the sampling variant of the step."""
  return bool(np.any(np.asarray(temperature) > 0) or np.any(np.asarray(penalty) != 1.0))


def stats(state: DecodeState) -> dict:
  """Acceptance statistics of the counters (host values)."""
  drafted, accepted = np.asarray(state.drafted), np.asarray(state.accepted)
  steps, emitted = np.asarray(state.row_steps), np.asarray(state.row_emitted)
  return {
      "steps": int(np.asarray(state.step)), "row_steps": int(steps.sum()),
      "acceptance_length": float(emitted.sum() / max(steps.sum(), 1)),
      "acceptance_rate_per_position": [float(a / d) if d else 0.0
                                       for a, d in zip(accepted, drafted)],
      "drafted": drafted.tolist(), "accepted": accepted.tolist(),
      "cond_trials": np.asarray(state.cond_trials).tolist(),
      "cond_hits": np.asarray(state.cond_hits).tolist(),
      "cond_weight": np.asarray(state.cond_weight).tolist(),
      "pos_trials": np.asarray(state.pos_trials).tolist(),
      "pos_hits": np.asarray(state.pos_hits).tolist(),
  }
