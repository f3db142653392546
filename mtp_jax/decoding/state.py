"""The decode state: a few sub-structs of fixed-shape arrays, donated into every compiled call.

Dimension letters: B slots, S positions (max_len), Kd drafts at most, V vocabulary, M sequential
modules, D model width, R ring records, n / P a prefill's rows and padded prompt length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtp_jax.decoding import adaptive, sampling
from mtp_jax.decoding import ring as ring_lib
from mtp_jax.models import cache as kv


@struct.dataclass
class Rows:
  """Per slot: the token buffer and where the row stands."""
  tokens: jax.Array        # [B, S] int32: prompt then generated tokens
  length: jax.Array        # [B] committed tokens (prompt included)
  prompt_len: jax.Array    # [B]
  stop_len: jax.Array      # [B] the length at which the row is finished
  done: jax.Array          # [B] bool (free slots are done)
  steps: jax.Array         # [B] decode steps while the row was active
  emitted: jax.Array       # [B] tokens emitted by decode steps
  cond_trials: jax.Array   # [B, Kd] since the row's insertion, per draft position: drafts
                           # reached (verified, every draft before accepted); adaptive k only
  cond_hits: jax.Array     # [B, Kd] and accepted there (the end of a job is planned with them)

  @property
  def out_pos(self):
    """[B] output tokens so far (the first generated token included)."""
    return self.length - self.prompt_len

  @property
  def remaining(self):
    """[B] tokens the row may still emit."""
    return self.stop_len - self.length


@struct.dataclass
class Drafts:
  """The drafts the next step verifies."""
  tokens: jax.Array        # [B, Kd] int32 (a tree engine: [B, Kd, R], each head's candidates
                           # by rank, the tree's nodes taken from them: tree_verify.node_tokens)
  logq: jax.Array          # [B, Kd, V] the drafter's processed log-probabilities of them
                           # (written by sampled steps; greedy steps leave it as it is)
  conf: jax.Array          # [B, Kd] the drafter's confidence (peak probability) per draft
  n_fresh: jax.Array       # [B] drafts made for the coming step (later ones are stale: a step
                           # of the adaptive loop drafts only what the next step may verify)


@struct.dataclass
class Caches:
  trunk: kv.KVCache
  draft: kv.KVCache | None  # the draft model's cache (drafter 'model'), or the sequential
                            # heads' caches (one layer per module), else None
  seq_h: jax.Array | None   # [B, M, D] sequential heads: module i's hidden state at its last
                            # position whose input token is committed (None otherwise)


@struct.dataclass
class Record:
  """What the steps did: the ring of the last R steps and the run's counters."""
  ring: ring_lib.Ring
  step: jax.Array          # [] steps run since init (indexes the ring)
  drafted: jax.Array       # [Kd] drafts verified, per draft position
  accepted: jax.Array      # [Kd] drafts accepted, per draft position
  cond_trials: jax.Array   # [Kd] drafts reached (verified, every draft before them accepted)
  cond_hits: jax.Array     # [Kd] and accepted there: the run's conditional acceptance per
                           # position (tables.run_rates), the next run's prior


@struct.dataclass
class DecodeState:
  """Everything a decode step reads and writes, fixed shapes (B slots, S positions, Kd drafts,
  V vocabulary, M sequential modules, R ring records)."""
  rows: Rows
  drafts: Drafts
  caches: Caches
  sampling: sampling.SamplingParams
  record: Record
  controller: adaptive.Controller | None   # adaptive k only


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
  drafts: jax.Array        # [n, Kd] (a tree engine: [n, Kd, R], as Drafts.tokens)
  draft_logq: jax.Array    # [n, Kd, V]
  draft_conf: jax.Array    # [n, Kd]
  key: jax.Array           # [n] the rows' PRNG keys for their decode steps


def stats(state: DecodeState, kd: int = 0) -> dict:
  """Acceptance statistics of the counters (host values). row_steps and acceptance_length are
  the rows' now in the slots (api.Decoder.run replaces them with the whole run's). kd: per
  draft position at least this many (zeros past the state's own: a plain engine's run reported
  as adaptive k's)."""
  rec, rows = state.record, state.rows
  pad = lambda x: np.pad(np.asarray(x), (0, max(kd - np.asarray(x).shape[0], 0)))
  drafted, accepted = pad(rec.drafted), pad(rec.accepted)
  steps, emitted = np.asarray(rows.steps), np.asarray(rows.emitted)
  return {
      "steps": int(np.asarray(rec.step)), "row_steps": int(steps.sum()),
      "acceptance_length": float(emitted.sum() / max(steps.sum(), 1)),
      "acceptance_rate_per_position": [float(a / d) if d else 0.0
                                       for a, d in zip(accepted, drafted)],
      "drafted": drafted.tolist(), "accepted": accepted.tolist(),
      "cond_trials": pad(rec.cond_trials).tolist(), "cond_hits": pad(rec.cond_hits).tolist(),
  }


def initial(eng, key, cost, prior, prior_trials=None) -> DecodeState:
  """The state of engine eng (engine.Engine) with no rows: key the base PRNG key, cost the cost
  table, prior adaptive k's acceptance per draft position (None: unknown) and prior_trials what
  it counts for (adaptive.init_controller)."""
  b, s, kd, v = eng.cfg.batch_size, eng.cfg.max_len, eng.kd, eng.model_cfg.vocab_size
  zeros_b = jnp.zeros((b,), jnp.int32)
  zeros_k = jnp.zeros((kd,), jnp.int32)
  rows = Rows(tokens=jnp.zeros((b, s), jnp.int32), length=jnp.ones((b,), jnp.int32),
              prompt_len=jnp.ones((b,), jnp.int32), stop_len=jnp.ones((b,), jnp.int32),
              done=jnp.ones((b,), bool), steps=zeros_b, emitted=zeros_b,
              cond_trials=jnp.zeros((b, kd), jnp.int32), cond_hits=jnp.zeros((b, kd), jnp.int32))
  draft_BK = (b, kd) if not eng.top_r else (b, kd, eng.top_r)   # trees: [B, Kd, R]
  drafts = Drafts(tokens=jnp.zeros(draft_BK, jnp.int32), logq=jnp.zeros((b, kd, v), jnp.float32),
                  conf=jnp.zeros((b, kd), jnp.float32), n_fresh=zeros_b)
  draft, seq_h = eng.drafter_impl.init_cache(b, s)
  caches = Caches(trunk=kv.init_cache(eng.model_cfg, b, s, *eng.cache_args), draft=draft,
                  seq_h=seq_h)
  record = Record(ring=ring_lib.init_ring(eng.cfg.ring_size, b, kd),
                  step=jnp.zeros((), jnp.int32), drafted=zeros_k, accepted=zeros_k,
                  cond_trials=zeros_k, cond_hits=zeros_k)
  controller = None
  if eng.cfg.adaptive:
    controller = adaptive.init_controller(kd, cost, eng.cfg.probe_every, eng.cfg.accept_window,
                                          prior, prior_trials)
  return DecodeState(rows=rows, drafts=drafts, caches=caches,
                     sampling=sampling.init_params(jax.random.split(key, b), b), record=record,
                     controller=controller)


def insert(eng, prefix: Prefix, state: DecodeState, slots, max_new, temperature, top_k, top_p,
           penalty) -> DecodeState:
  """state with the prefilled rows of `prefix` put into `slots` (engine.Engine.insert, jitted;
  eng: the engine)."""
  n, p = prefix.tokens.shape
  s = eng.cfg.max_len
  rows = slots[:, None]

  def put(cache, rows_cache):    # the prefix's positions 0..P'-1 into the slots' rows
    cols = jnp.arange(rows_cache.max_len)[None, :]
    return jax.tree.map(lambda c, pc: c.at[rows, cols].set(pc.astype(c.dtype)), cache,
                        rows_cache)

  c = state.caches
  caches = Caches(trunk=put(c.trunk, prefix.cache),
                  draft=None if c.draft is None else put(c.draft, prefix.draft_cache),
                  seq_h=None if c.seq_h is None else c.seq_h.at[slots].set(prefix.seq_h))
  row_tokens = jnp.zeros((n, s), jnp.int32).at[:, :p].set(prefix.tokens)
  row_tokens = jnp.where(jnp.arange(s)[None] < prefix.length[:, None], row_tokens, 0)
  row_tokens = row_tokens.at[jnp.arange(n), prefix.length].set(prefix.first)
  length = prefix.length + 1
  stop_len = jnp.minimum(prefix.length + max_new, s - eng.span - 1)
  done = (length >= stop_len) | jnp.isin(prefix.first, jnp.asarray(eng.end_ids))
  z = jnp.zeros((n,), jnp.int32)
  r = state.rows
  rows_ = Rows(tokens=r.tokens.at[slots].set(row_tokens), length=r.length.at[slots].set(length),
               prompt_len=r.prompt_len.at[slots].set(prefix.length),
               stop_len=r.stop_len.at[slots].set(stop_len), done=r.done.at[slots].set(done),
               steps=r.steps.at[slots].set(z), emitted=r.emitted.at[slots].set(z),
               cond_trials=r.cond_trials.at[slots].set(0), cond_hits=r.cond_hits.at[slots].set(0))
  d = state.drafts
  drafts = Drafts(tokens=d.tokens.at[slots].set(prefix.drafts),
                  logq=d.logq.at[slots].set(prefix.draft_logq),
                  conf=d.conf.at[slots].set(prefix.draft_conf),
                  n_fresh=d.n_fresh.at[slots].set(eng.kd))
  sp = state.sampling
  sp = sampling.SamplingParams(
      key=sp.key.at[slots].set(prefix.key), temperature=sp.temperature.at[slots].set(temperature),
      top_k=sp.top_k.at[slots].set(top_k), top_p=sp.top_p.at[slots].set(top_p),
      penalty=sp.penalty.at[slots].set(penalty))
  return state.replace(rows=rows_, drafts=drafts, caches=caches, sampling=sp)
