"""The speculative decode engine: prefill / insert / generate over a fixed-shape DecodeState.

One step (step.py: input, trunk, verify, commit, draft, record) runs for every row at once;
k = 0 is plain decoding through the same code. `generate` runs these steps in jitted
`lax.while_loop`s (loop.py; state donated) until `num_steps` steps ran or every row is done.
Rows stop at an end token (end_ids), at their own max_new_tokens, or when the cache is full.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.config import DecodeConfig, HeadsConfig, ModelConfig
from mtp_jax.decoding import drafters, sampling, shape_set
from mtp_jax.decoding import loop as loop_lib
from mtp_jax.decoding import state as state_lib
from mtp_jax.decoding import step as step_lib
from mtp_jax.decoding.drafters.base import history, peak_prob  # noqa: F401  (peak_prob: re-exported)
from mtp_jax.decoding.shapes import Chain, Tree
from mtp_jax.decoding.state import Caches, DecodeState, Drafts, Prefix, Record, Rows, stats  # noqa: F401
from mtp_jax.models import cache as kv
from mtp_jax.models import model as model_lib

__all__ = ["Caches", "DecodeState", "Drafts", "Engine", "Prefix", "Record", "Rows", "stats"]


class Engine:
  """Compiled prefill / insert / generate for one model and one DecodeConfig.

  Greedy and sampling steps are two compiled variants of generate, chosen per call by whether
  any row samples or has a repetition penalty (the sampling variant handles greedy rows exactly,
  as one-hot distributions); both are compiled at warm-up, so sampling parameters never
  recompile.
  """

  def __init__(self, model_cfg: ModelConfig, heads_cfg: HeadsConfig, decode_cfg: DecodeConfig,
               eod_id: int | Sequence[int],
               draft_model: tuple[ModelConfig, HeadsConfig] | None = None,
               mesh: jax.sharding.Mesh | None = None):
    """draft_model: the (model, heads) configs of the draft model when decode_cfg.drafter is
    'model'; params are then (target params, draft params). mesh: the decode state is sharded
    on it (slots on 'data', KV heads on 'model'; see sharding.py) and stays so across calls;
    params are expected on the same mesh (Decoder places them). eod_id: the token that ends a
    row, or several (Tokenizer.end_ids: end of document first, then an end-of-turn token)."""
    self.model_cfg, self.heads_cfg = model_cfg, heads_cfg
    self.cfg = shape_set.resolve(decode_cfg, model_cfg, heads_cfg)
    self.end_ids = tuple(int(i) for i in np.atleast_1d(eod_id))
    self.eod_id = self.end_ids[0]
    self.graphdef, _ = model_lib.abstract(model_cfg, heads_cfg)
    if (self.cfg.drafter == "model") != (draft_model is not None):
      raise ValueError("a draft model is needed exactly when decode.drafter='model'")
    self.draft_cfg = draft_model
    if draft_model is not None:
      if draft_model[0].vocab_size != model_cfg.vocab_size:
        raise ValueError(f"draft model vocab_size={draft_model[0].vocab_size} differs from the "
                         f"target's {model_cfg.vocab_size}")
      self.draft_graphdef, _ = model_lib.abstract(*draft_model)
    self.kd = self.cfg.k
    # A tree engine verifies its tree every step (kd: its depth); span: the inputs a step adds
    # past the last committed token (k, or T nodes), kept free at the end of every row's cache.
    self.tree = Tree(self.cfg.tree) if self.cfg.tree else None
    # Adaptive k's candidates: chains 0..Kd, then trees (shape_set.py).
    self.shape_set = shape_set.make(self.cfg, heads_cfg) if self.cfg.adaptive else None
    # Adaptive k's trees do not widen it: a tree is chosen only where every row has room for
    # it (loop.allowed).
    self.span = self.kd if self.tree is None else self.tree.size
    # The rows of the step's widest unembedding product (model.unembed_copy picks the layout
    # from it): a fixed shape verifies span + 1 tokens a row every step; adaptive k's plain steps
    # unembed one row a slot.
    self.unembed_rows = self.cfg.batch_size * (1 if self.cfg.adaptive else self.span + 1)
    # Seconds per step for each shape (k = 0..Kd, then trees), set by the host (costs.py);
    # until then equal costs (the controller then only weighs expected tokens).
    self.cost = [1.0] * self.n_shapes
    # Adaptive k's shapes compiled besides plain decoding (ks): every shape unless the host
    # narrows it and opens shapes as the controller wants them (api.Decoder).
    self.opened = set(range(1, self.n_shapes))
    # Adaptive k's programs compiled behind the run (programs.py; set by the host that opens
    # shapes as the run goes); None: each compiled when first called.
    self.programs = None
    self.dtype = model_lib.compute_dtype(model_cfg)
    # The trunk's (and a draft model's) KV cache: storage dtype, how attention reads it.
    self.cache_args = (kv.storage_dtype(self.cfg.kv_dtype, self.dtype), self.cfg.attention,
                       self.cfg.attention_block)
    self.drafter = self.cfg.drafter          # the kind: heads | ngram | model
    self.drafter_impl = drafters.make(self.cfg, model_cfg, heads_cfg, self.dtype,
                                      self.cache_args,
                                      None if draft_model is None else draft_model[0],
                                      top_r=self.top_r)
    self.step_cfg = step_lib.StepConfig(
        kd=self.kd, end_ids=self.end_ids, vocab_size=model_cfg.vocab_size,
        conf_threshold=self.cfg.confidence_threshold, adaptive=self.cfg.adaptive)
    self.mesh = mesh
    self.state_sharding = None
    if mesh is not None:
      from mtp_jax import sharding as sharding_lib
      self.state_sharding = sharding_lib.decode_state_shardings(
          jax.eval_shape(self._init_state_unplaced), mesh, self.cfg.batch_size)
    out = self.state_sharding
    self._prefill = jax.jit(self._prefill_impl, static_argnames=("sample",))
    self._insert = jax.jit(functools.partial(state_lib.insert, self), donate_argnames=("state",),
                           out_shardings=out)
    self._generate = jax.jit(self._generate_impl, static_argnames=("sample", "ks"),
                             donate_argnames=("state",), out_shardings=out)
    self._stays_plain = jax.jit(functools.partial(loop_lib.stays_plain, self))
    self._cancel = jax.jit(
        lambda state, mask: state.replace(rows=state.rows.replace(done=state.rows.done | mask)),
        donate_argnums=0, out_shardings=out)
    # A fresh state in one compiled call, committed to its devices like every state the
    # compiled calls return (so that both hit the same executables); built op by op it cost
    # milliseconds of host time at the start of every run.
    self._init = jax.jit(self._init_state_unplaced, out_shardings=out if out is not None else
                         jax.sharding.SingleDeviceSharding(jax.devices()[0]))

  # ------------------------------------------------------------------ state

  @property
  def n_shapes(self) -> int:
    """Cost table entries: k = 0..Kd, then adaptive k's trees."""
    return self.kd + 1 if self.shape_set is None else self.shape_set.size

  @property
  def top_r(self) -> int:
    """Candidates per head the drafts hold (0: one draft per head, [B, Kd])."""
    if self.tree is not None:
      return self.tree.top_k
    return 0 if self.shape_set is None else self.shape_set.top_r

  def cost_array(self, cost) -> np.ndarray:
    """cost with an entry per shape: a shape with no measured cost gets +inf (never chosen)."""
    c = np.full((self.n_shapes,), np.inf, np.float32)
    c[:len(cost)] = np.asarray(cost, np.float32)[:self.n_shapes]
    return c

  def init_state(self, seed: int = 0, prior=None, prior_trials=None) -> DecodeState:
    """prior [Kd]: adaptive k's acceptance per draft position from earlier runs (-1 unknown);
    prior_trials [Kd]: the pseudo-trials it counts for (priors.py; default one window, as
    where the rate is unknown: adaptive.init_controller)."""
    return self._init(jax.random.key(seed), self.cost_array(self.cost),
                      *self._prior(prior, prior_trials))

  def _prior(self, prior, prior_trials):
    return (np.asarray([-1.0] * self.kd if prior is None else prior, np.float32),
            np.asarray([self.cfg.accept_window] * self.kd if prior_trials is None
                       else prior_trials, np.float32))

  def _init_state_unplaced(self, key=None, cost=None, prior=None, prior_trials=None):
    """-> the DecodeState of an engine with no rows (key: the base PRNG key, default key(0);
    cost: the cost table, default self.cost; prior, prior_trials: see init_state)."""
    cost = self.cost_array(self.cost) if cost is None else cost
    return state_lib.initial(self, jax.random.key(0) if key is None else key, cost, prior,
                             prior_trials)

  @staticmethod
  def put(state: DecodeState, **values) -> DecodeState:
    """state with controller fields (adaptive.Controller) set from host values, each placed as
    the field already is: an uncommitted array is another argument kind to the compiled calls,
    which would compile again for it (the whole generate program)."""
    ctrl = state.controller
    return state.replace(controller=ctrl.replace(**{
        name: jax.device_put(np.asarray(v, getattr(ctrl, name).dtype),
                             getattr(ctrl, name).sharding) for name, v in values.items()}))

  def bucket(self, n: int) -> int:
    """The prefill bucket (a power of two >= min_bucket, at most max_len - span - 1) for n
    tokens."""
    cap = self.cfg.max_len - self.span - 1
    if n > cap:
      raise ValueError(f"prompt of {n} tokens does not fit the context ({self.cfg.max_len} "
                       f"positions, {self.span + 1} kept free for one step)")
    b = self.cfg.min_bucket
    while b < n:
      b *= 2
    return min(b, cap)

  @property
  def ks(self) -> tuple[int, ...] | None:
    """Adaptive k: the shapes (indices: k = 0..Kd, then trees) the adaptive loop compiles: plain
    decoding and the opened ones (open); None for a fixed-k engine."""
    if not self.cfg.adaptive:
      return None
    return (0,) + tuple(sorted(self.opened - {0}))

  def open(self, shapes) -> bool:
    """Adds shapes to those compiled (the next generate call compiles them). -> whether any
    was new."""
    new = set(int(s) for s in shapes) - self.opened - {0}
    self.opened |= new
    return bool(new)

  def stays_plain(self, prior=None, prior_trials=None) -> bool:
    """Adaptive k: whether a run from this prior (init_state's) can never leave plain decoding
    (loop.stays_plain)."""
    if not self.cfg.adaptive:
      return False
    prior, m = self._prior(prior, prior_trials)
    return bool(self._stays_plain(self.cost_array(self.cost), prior, m))

  def buckets(self, max_prompt_len: int | None = None) -> list[int]:
    top = self.bucket(max_prompt_len or self.cfg.max_len - self.span - 1)
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
    self.stays_plain()
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
      if self.programs is not None:
        self.programs.compile_now(self._args(params, state, 1), sample, self.ks)
      state = self.generate(params, state, 1, sample=sample)
    state = self.cancel(state, np.zeros((self.cfg.batch_size,), bool))
    jax.block_until_ready(state)
    return len(buckets)

  def _bind(self, params, unembed):
    """-> (target model, draft model or None) as a decode call runs them, unembed the copies
    `self.unembed` made (model.for_decoding)."""
    if self.cfg.drafter == "model":
      return (model_lib.for_decoding(model_lib.bind(self.graphdef, params[0]), unembed[0]),
              model_lib.for_decoding(model_lib.bind(self.draft_graphdef, params[1]), unembed[1]))
    return model_lib.for_decoding(model_lib.bind(self.graphdef, params), unembed[0]), None

  def unembed(self, params):
    """The [D, V] copies of tied embeddings that this engine's calls unembed from
    (model.unembed_copy; None where none is made), one per model: made when params are first
    seen (their embeddings compared by identity) and kept for the calls that follow."""
    pairs = ([(self.model_cfg, params[0]), (self.draft_cfg[0], params[1])]
             if self.cfg.drafter == "model" else [(self.model_cfg, params)])
    src = tuple(p["trunk"]["embed_VD"] for _, p in pairs)
    made = getattr(self, "_unembed", None)
    if made is None or any(a is not b for a, b in zip(made[0], src)):
      copies = tuple(model_lib.unembed_copy(c, p, self.unembed_rows) for c, p in pairs)
      self._unembed = made = src, copies
    return made[1]

  # ------------------------------------------------------------------ prefill / insert

  def _prefill_impl(self, params, unembed, tokens_NP, length_N, key, temperature, top_k, top_p,
                    penalty, sample: bool):
    n, p = tokens_NP.shape
    m, dm = self._bind(params, unembed)
    cache = kv.init_cache(self.model_cfg, n, p, *self.cache_args)
    h, cache = m(tokens_NP, jnp.broadcast_to(jnp.arange(p), (n, p)), cache)
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
      first = sampling.argmax(logits)
    # The drafters that read tokens draft from the history, the first token included.
    hist = history(tokens_NP, length_N, first, self.kd)
    drafts, logq, conf, dcache, seq_h = self.drafter_impl.prefill(
        m, dm, tokens_NP, length_N, h, hist, k_draft, sp, presence, sample)
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
    # Host values go to the jitted call as numpy arrays: a jnp.asarray each would be a device
    # dispatch of its own (~50 us on a CPU host, several per call).
    return self._prefill(params, self.unembed(params), arr, np.asarray(lengths, np.int32), key,
                         temperature, np.asarray(top_k, np.int32), np.asarray(top_p, np.float32),
                         penalty, sample=needs_sampling(temperature, penalty))

  def insert(self, prefix: Prefix, state: DecodeState, slots, max_new, temperature, top_k,
             top_p, penalty=1.0) -> DecodeState:
    """Puts prefilled rows into slots (state donated). max_new counts the first token. A slot
    index >= batch_size drops its row (padding rows of a prefill call)."""
    f = lambda x, d: np.ascontiguousarray(np.broadcast_to(np.asarray(x, d), (len(slots),)))
    return self._insert(prefix, state, f(slots, np.int32), f(max_new, np.int32),
                        f(temperature, np.float32), f(top_k, np.int32), f(top_p, np.float32),
                        f(penalty, np.float32))

  def cancel(self, state: DecodeState, mask) -> DecodeState:
    """Marks the rows where mask [B] is true as done (state donated): a row the host finished,
    e.g. on a stop string, stops using the device."""
    return self._cancel(state, np.asarray(mask, bool))

  # ------------------------------------------------------------------ the step

  def shape(self, k: int) -> Chain | Tree:
    """The shape of index k: a tree engine's tree; else a chain of k drafts (k <= Kd) or
    adaptive k's tree."""
    if self.tree is not None:
      return self.tree
    return Chain(k) if self.shape_set is None else self.shape_set.shape(k)

  def depth(self, k: int) -> int:
    """The drafts a step of shape k reads (a chain's k, a tree's depth)."""
    shape = self.shape(k)
    return shape.k if isinstance(shape, Chain) else shape.max_depth

  def step(self, m, state: DecodeState, k: int, sample: bool, n_draft: int | None = None,
           dm=None, want_conf: bool = True, ranked: bool = True) -> DecodeState:
    """One step verifying shape k (a tree engine's tree; see step.step). ranked: draft each
    head's top candidates where the state holds them (a loop with no tree drafts the best
    token alone)."""
    return step_lib.step(self.step_cfg, self.drafter_impl, m, dm, state, self.shape(k), sample,
                         n_draft, want_conf, ranked, index=k if self.tree is None else None)

  def _generate_impl(self, params, unembed, state: DecodeState, num_steps, refill, idle_steps,
                     closed, sample: bool, ks: tuple[int, ...] | None = None):
    m, dm = self._bind(params, unembed)
    run = loop_lib.Loop(self, m, dm, state, num_steps, refill, idle_steps, closed, sample, ks)
    return run.adaptive(state) if self.cfg.adaptive else run.fixed(state, self.kd, None)

  def generate(self, params, state: DecodeState, num_steps: int | None = None,
               sample: bool | None = None, refill: int = 0,
               idle_steps: float = float("inf"), closed: bool = False) -> DecodeState:
    """Runs up to num_steps (<= ring capacity) steps; `state` is donated. refill > 0 (requests
    wait for slots): stop after the step in which the refill-th row finishes, or once the rows
    finished in this call have stood idle idle_steps slot-steps in all (0: as soon as one
    finishes; inf: no such limit); neither is a compiled variant. closed: no request will take a
    slot any more: adaptive k plans the end of the job, not tokens per second."""
    num_steps = self.cfg.ring_size if num_steps is None else num_steps
    if not 0 < num_steps <= self.cfg.ring_size:
      raise ValueError(f"num_steps={num_steps} must be in 1..ring_size={self.cfg.ring_size}")
    if sample is None:
      sp = state.sampling
      sample = needs_sampling(np.asarray(sp.temperature), np.asarray(sp.penalty))
    args = self._args(params, state, num_steps, refill, idle_steps, closed)
    if self.programs is not None:     # adaptive k: programs compiled behind the run
      return self.programs.run(args, sample, self.ks)
    return self._generate(*args, sample=sample, ks=self.ks)

  def _args(self, params, state, num_steps, refill=0, idle_steps=float("inf"), closed=False):
    return (params, self.unembed(params), state, np.int32(num_steps), np.int32(refill),
            np.float32(idle_steps), np.bool_(closed))


def needs_sampling(temperature, penalty) -> bool:
  """Whether rows with these parameters need the sampling variant of the step."""
  return bool(np.any(np.asarray(temperature) > 0) or np.any(np.asarray(penalty) != 1.0))
