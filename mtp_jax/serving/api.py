"""The Python API: load a model directory, generate for a list of prompts.

  from mtp_jax.serving import api
  dec = api.Decoder.load("pretrained/demo", batch_size=8, k=3)
  for c in dec.generate(["def f(x):\\n"], max_new_tokens=64):
    print(c.text, c.acceptance_length)

Prompts are served from a queue into the engine's slots (continuous batching): whenever a row
finishes, the slot is refilled by prefill + insert between generate calls.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax import config as config_lib
from mtp_jax import sharding as sharding_lib
from mtp_jax.config import DecodeConfig
from mtp_jax.decoding import engine as engine_lib
from mtp_jax.decoding import priors as priors_lib
from mtp_jax.decoding import ring as ring_lib
from mtp_jax.decoding import shape_set, shapes, tables
from mtp_jax.decoding import state as state_lib
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.serving import refill as refill_lib


@dataclasses.dataclass
class Completion:
  text: str
  token_ids: list[int]
  finish_reason: str          # 'stop' (end token) or 'length' (max_new_tokens or full context)
  prompt_tokens: int
  steps: int                  # decode steps (the first token comes from prefill)
  acceptance_length: float    # tokens emitted per decode step
  ttft_s: float = 0.0         # from the start of run() to the host holding the first token
  latency_s: float = 0.0      # from the start of run() to the host holding the last token


@dataclasses.dataclass
class Request:
  prompt_ids: list[int]
  max_new_tokens: int = 128
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  repetition_penalty: float = 1.0
  stop: tuple[str, ...] = ()     # the text ends before the first of these strings
  seed: int | None = None        # the row's own PRNG seed (None: derived from the run's seed)


class Decoder:
  def __init__(self, model_cfg, heads_cfg, params, tokenizer, decode_cfg: DecodeConfig,
               seed: int = 0, draft=None, mesh=None, rules: str = config_lib.DEFAULT_RULES):
    """draft: (model config, heads config, params) of a draft model, for drafter='model'.
    mesh: a jax Mesh ('data', 'model') to decode on: params are placed by the logical-axis
    `rules`, the decode state by slots and KV heads (sharding.py)."""
    self.tokenizer = tokenizer
    self.params = params if draft is None else (params, draft[2])
    if mesh is not None:
      parsed = sharding_lib.parse_rules(rules)
      self.params = jax.device_put(self.params,
                                   sharding_lib.tree_shardings(self.params, mesh, parsed))
    draft_cfgs = None if draft is None else draft[:2]
    self.engine = engine_lib.Engine(model_cfg, heads_cfg, decode_cfg, tokenizer.end_ids,
                                    draft_cfgs, mesh=mesh)
    # Adaptive k hands a run its controller can never take off plain decoding to a plain
    # engine of the same slots (Engine.stays_plain): plain decoding's own program, not the
    # adaptive loop's plain steps, its controller and its heads at prefill.
    self.plain = (engine_lib.Engine(model_cfg, heads_cfg,
                                    dataclasses.replace(decode_cfg, adaptive=False, k=0,
                                                        adaptive_trees=(), tree_rates=()),
                                    tokenizer.end_ids, draft_cfgs, mesh=mesh)
                  if decode_cfg.adaptive else None)
    if self.plain is not None:      # one copy of a tied unembedding for both
      self.plain.unembed = self.engine.unembed
    self.seed = seed
    self.last_stats: dict = {}
    # Acceptance per draft position that earlier runs measured: adaptive k's prior.
    self.priors = priors_lib.Priors(self.engine.kd, decode_cfg.accept_window)
    self._fingerprint: str | None = None
    self.last_timing: dict = {}

  @classmethod
  def load(cls, model_dir: str, batch_size: int = 8, k: int | str = -1, max_len: int = 0,
           ring_size: int = 32, seed: int = 0, draft_dir: str | None = None,
           mesh: str | None = None, **decode_options) -> "Decoder":
    """k: drafts per step (-1 all heads, 0 plain decoding), 'auto' (adaptive: chains up to all
    heads and, with parallel heads, the model's trees: shape_set.auto_options) or 'tree:T':
    every step verifies a token tree of T nodes from the parallel heads' top candidates
    (model_dir/trees.json's tree for T, else one built from the rates stored there, else the
    default: shapes.tree_for). draft_dir: a draft model directory (drafts come from it instead
    of the heads).
    mesh: a mesh shape ('data:2,model:4'; '' = every device on 'data'), None = one device.
    decode_options: other DecodeConfig fields (confidence_threshold, drafter, ...)."""
    mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(model_dir)
    draft = None
    if draft_dir:
      dm, dh, dp, dtok = ckpt_lib.load_model_dir(draft_dir)
      if dtok.hf.to_str() != tok.hf.to_str():
        raise ckpt_lib.ModelDirError(f"{draft_dir}: the draft model's tokenizer differs from "
                                     f"{model_dir}'s")
      draft = (dm, dh, dp)
      decode_options["drafter"] = "model"
    adaptive = k == "auto"
    if adaptive:
      decode_options = {**shape_set.auto_options(hcfg, model_dir, decode_options),
                        **decode_options}
    budget = shapes.tree_budget(k)
    if budget is not None:
      decode_options["tree"] = shapes.tree_for(budget, hcfg.num, model_dir).choices
    dcfg = DecodeConfig(batch_size=batch_size, k=-1 if adaptive or budget else int(k),
                        max_len=max_len, ring_size=ring_size, adaptive=adaptive,
                        **decode_options)
    return cls(mcfg, hcfg, params, tok, dcfg, seed, draft,
               mesh=None if mesh is None else sharding_lib.make_mesh(mesh))

  def calibrate(self, table_path: str | None = None, force: bool = False) -> list[float]:
    """Cost table of the adaptive controller (see Engine.calibrate). The same file then keeps
    the acceptance per draft position that this model's runs measure (tables.rates_key): a
    later process starts from it where the heads' confidence alone would be its only guide (the
    confidence understates how often greedy drafts are accepted, and a first run would decode
    plainly until probes had shown otherwise)."""
    cost = self.engine.calibrate(self.params, table_path, force)
    if self.engine.cfg.adaptive:
      self.priors.path = table_path or tables.default_table_path()
      if self._fingerprint is None:
        self._fingerprint = tables.params_fingerprint(self.params)
      self.priors.keys = {s: tables.rates_key(self.engine, self._fingerprint, s)
                          for s in (False, True)}
    return cost

  def warmup(self, max_prompt_len: int | None = None) -> int:
    """Compiles every shape serving can meet (see Engine.warmup), the copy a chunk's drain
    makes of the ring and the rows' key folding, so that the first run compiles nothing.
    -> the number of buckets."""
    n = self.engine.warmup(self.params, max_prompt_len)
    if self.plain is not None:
      self.plain.warmup(self.params, max_prompt_len)
      ring_lib.Drain().drain(*_drained(self.plain, self.plain.init_state()))
    ring_lib.Drain().drain(*_drained(self.engine, self.engine.init_state()))
    jax.block_until_ready(jax.random.fold_in(jax.random.key(self.seed), 0))   # rows' keys (run)
    return n

  def generate(self, prompts: Sequence[str], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0,
               repetition_penalty: float = 1.0, stop: Sequence[str] = (),
               seed: int | None = None) -> list[Completion]:
    reqs = [Request(self.tokenizer.encode(p), max_new_tokens, temperature, top_k, top_p,
                    repetition_penalty, tuple(stop), None if seed is None else seed + i)
            for i, p in enumerate(prompts)]
    return self.run(reqs)

  def chat(self, conversations: Sequence[list[dict]], max_new_tokens: int = 128,
           temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           repetition_penalty: float = 1.0, stop: Sequence[str] = (),
           seed: int | None = None) -> list[Completion]:
    """generate for conversations (OpenAI-style messages), each rendered with the model's chat
    template and a generation prompt; a row ends at the end-of-turn token. Completion.text is the
    assistant's answer. Raises chat.ChatError for a conversation that cannot be rendered."""
    reqs = [Request(self.tokenizer.encode_chat(m), max_new_tokens, temperature, top_k, top_p,
                    repetition_penalty, tuple(stop), None if seed is None else seed + i)
            for i, m in enumerate(conversations)]
    return self.run(reqs)

  def run(self, requests: Sequence[Request], on_done=None) -> list[Completion]:
    """Decodes every request; results in request order. `on_done(index, completion)` is called
    as each request finishes (in finishing order), for streaming output.

    Host work overlaps the device: a finished row's completion is detokenised and handed to
    on_done after the next chunk has been launched. A row whose text reaches one of its stop
    strings is finished on the host and cancelled on the device at the next chunk boundary.
    """
    eng = self.engine
    sampled_run = any(engine_lib.needs_sampling(r.temperature, r.repetition_penalty)
                      for r in requests)
    t_start = time.perf_counter()       # the run's clock counts the choice of engine too
    prior = self.priors.start(sampled_run) if eng.cfg.adaptive else (None, None)
    if eng.stays_plain(*prior):
      eng, prior = self.plain, (None, None)
    slots = _Slots(self, eng, requests, on_done, t_start)
    state = self._decode(eng.init_state(self.seed, *prior), slots)
    self.last_stats = state_lib.stats(state, self.engine.kd)
    # The rows' counters restart where a request takes a slot: the run's come from every request.
    outs = [c for c in slots.results if c is not None]
    row_steps = sum(c.steps for c in outs)
    emitted = sum(round(c.acceptance_length * c.steps) for c in outs)
    self.last_stats.update(row_steps=row_steps, acceptance_length=emitted / max(row_steps, 1))
    if eng.cfg.adaptive:     # the acceptance this run saw: the next run's prior (adaptive k)
      counts = np.asarray(slots.counts, np.float64).reshape(len(slots.counts), 2, eng.kd)
      self.priors.learn(sampled_run, counts[:, 0], counts[:, 1])
    self.last_timing = {"wall_s": time.perf_counter() - slots.t_start, "wait_s": slots.wait}
    return slots.results

  def _decode(self, state, slots: "_Slots"):
    """The chunk loop: generate, hand over, drain, refill, until every request is done.

    While requests wait, a finished row is refilled right after its chunk, so the host reads
    each chunk before launching the next. Once the queue is empty nothing needs refilling: the
    next chunk is launched first and the previous one drained while the device runs it, unless
    the chunk in flight ends every row (_Slots.finish_within): then nothing more is launched."""
    eng = slots.eng
    drain = ring_lib.Drain()
    clock = refill_lib.RefillClock(eng.cfg.batch_size)
    chunk = eng.cfg.ring_size           # steps a chunk may run (the ring holds them all)
    state = slots.fill(state)
    while slots.busy():
      if drain.pending and not slots.queue and slots.finish_within(chunk):
        slots.collect(slots.timed(drain.finish))   # the chunk in flight ends every row
        continue
      state = slots.apply_cancel(state)
      # While requests wait, the chunk ends once every waiting request has a free slot, or once
      # the freed slots' idleness outweighs a refill's cost (refill.py).
      clock.launch()
      state = eng.generate(self.params, state, chunk, sample=slots.sampling(),
                           refill=min(len(slots.queue), eng.cfg.batch_size),
                           idle_steps=clock.idle_steps(), closed=not slots.queue)
      slots.hand_over()                 # detokenise and write while the chunk runs
      if drain.pending:
        slots.collect(slots.timed(drain.finish))
      drain.start(*_drained(eng, state))
      if slots.queue or not slots.busy():
        step0 = drain.drained_step
        slots.collect(slots.timed(drain.finish))
        clock.chunk_done(drain.drained_step - step0, refilling=bool(slots.queue))
        state = slots.fill(slots.apply_cancel(state))   # before a new request takes the slot
    if drain.pending:
      slots.collect(slots.timed(drain.finish))
    slots.hand_over()
    return state

  def _finish(self, req: Request, ids: list[int], steps: int) -> Completion:
    reason = "length"
    emitted = len(ids) - 1                               # tokens from decode steps
    ends = [i for i, t in enumerate(ids) if t in self.tokenizer.end_ids]
    if ends:
      ids, reason = ids[: ends[0]], "stop"
    text = self.tokenizer.decode(ids)
    cut, stop = _find_stop(text, req.stop)
    if cut >= 0:
      # Keep the tokens up to the one that completed the stop string; the text ends before it.
      lo, hi = 1, len(ids)
      while lo < hi:
        mid = (lo + hi) // 2
        if _find_stop(self.tokenizer.decode(ids[:mid]), (stop,))[0] >= 0:
          hi = mid
        else:
          lo = mid + 1
      ids, text, reason = ids[:lo], text[:cut], "stop"
    return Completion(text=text, token_ids=ids, finish_reason=reason,
                      prompt_tokens=len(req.prompt_ids), steps=steps,
                      acceptance_length=emitted / steps if steps else 0.0)


class _Slots:
  """The host's side of a run: which request each slot serves, the queue of waiting requests,
  the rows' token streams, and the finished completions."""

  def __init__(self, dec: Decoder, eng, requests: Sequence[Request], on_done, t_start: float):
    """eng: the engine that runs them (the decoder's, or its plain one: Decoder.run); t_start:
    the run's start (perf_counter)."""
    b = eng.cfg.batch_size
    self.dec, self.eng, self.requests, self.on_done = dec, eng, requests, on_done
    self.t_start = t_start
    self.wait = 0.0                    # seconds blocked on the device (for host overhead)
    self.ttft = [0.0] * len(requests)
    self.base_key = jax.random.key(dec.seed)
    self.queue = list(range(len(requests)))[::-1]
    self.slot_req = [-1] * b
    self.streams: list[list[int]] = [[] for _ in range(b)]
    self.results: list[Completion | None] = [None] * len(requests)
    self.sampled = np.zeros((b,), bool)
    self.free = list(range(b))[::-1]
    self.finished: list[tuple] = []    # (request, tokens, steps, latency) of rows not handed over
    self.counts: list[tuple] = []      # adaptive k: each finished row's (cond_trials, cond_hits)
    self.cancel = np.zeros((b,), bool)

  def busy(self) -> bool:
    return any(r >= 0 for r in self.slot_req)

  def finish_within(self, steps: int) -> bool:
    """Whether every row in use is done after `steps` more steps, by its token budget alone:
    a step emits at least one token per active row, and a row stops once it has max_new_tokens
    (its stream holds those drained so far, the prefill's first token included)."""
    return all(self.requests[r].max_new_tokens - len(self.streams[s]) <= steps
               for s, r in enumerate(self.slot_req) if r >= 0)

  def sampling(self) -> bool:
    """Whether a row in use samples (the sampling variant of generate)."""
    return bool(np.any(self.sampled & (np.asarray(self.slot_req) >= 0)))

  def timed(self, fn):
    t0 = time.perf_counter()
    out = fn()
    self.wait += time.perf_counter() - t0
    return out

  def apply_cancel(self, state):
    """Stops on the device the rows the host finished (stop strings)."""
    if self.cancel.any():
      state = self.eng.cancel(state, self.cancel)
      self.cancel[:] = False
    return state

  def fill(self, state):
    """Prefills waiting requests into free slots, up to prefill_rows per call (a call of
    several rows is padded to prefill_rows with rows that insert drops)."""
    eng, b = self.eng, self.eng.cfg.batch_size
    g = eng.cfg.prefill_rows
    while self.free and self.queue:
      take = min(len(self.free), len(self.queue), g)
      slots, reqs = [], []
      for _ in range(take):
        slot, r = self.free.pop(), self.queue.pop()
        slots.append(slot)
        reqs.append(self.requests[r])
        self.slot_req[slot] = r
        self.sampled[slot] = engine_lib.needs_sampling(self.requests[r].temperature,
                                                       self.requests[r].repetition_penalty)
      keys = [jax.random.key(q.seed) if q.seed is not None
              else jax.random.fold_in(self.base_key, self.slot_req[s])
              for q, s in zip(reqs, slots)]
      if take > 1:
        pad = g - take
        reqs += [Request(reqs[0].prompt_ids[:1], 1)] * pad
        slots += [b] * pad
        keys += [self.base_key] * pad
      prefix = eng.prefill(self.dec.params, [q.prompt_ids for q in reqs], jnp.stack(keys),
                           [q.temperature for q in reqs], [q.top_k for q in reqs],
                           [q.top_p for q in reqs], [q.repetition_penalty for q in reqs])
      state = eng.insert(prefix, state, slots, [q.max_new_tokens for q in reqs],
                         [q.temperature for q in reqs], [q.top_k for q in reqs],
                         [q.top_p for q in reqs], [q.repetition_penalty for q in reqs])
      first = self.timed(lambda: np.asarray(prefix.first))
      now = time.perf_counter()
      for i in range(take):
        self.streams[slots[i]] = [int(first[i])]
        self.ttft[self.slot_req[slots[i]]] = now - self.t_start
    return state

  def release(self, slot, row_steps, counts):
    if counts:
      self.counts.append((counts[0][slot], counts[1][slot]))
    self.finished.append((self.slot_req[slot], self.streams[slot], int(row_steps[slot]),
                          time.perf_counter() - self.t_start))
    self.slot_req[slot] = -1
    self.free.append(slot)

  def collect(self, records):
    """Appends a drained chunk to the streams; releases rows that are done."""
    tokens, emitted, _, _, done, row_steps, *counts = records
    ring_lib.append_streams(self.streams, tokens, emitted)
    for slot in range(len(self.slot_req)):
      r = self.slot_req[slot]
      if r < 0:
        continue
      if done[slot]:
        self.release(slot, row_steps, counts)
      elif self.requests[r].stop and _find_stop(self.dec.tokenizer.decode(self.streams[slot]),
                                                self.requests[r].stop)[0] >= 0:
        self.cancel[slot] = True
        self.release(slot, row_steps, counts)

  def hand_over(self):
    for r, ids, steps, latency in self.finished:
      self.results[r] = self.dec._finish(self.requests[r], ids, steps)
      self.results[r].ttft_s, self.results[r].latency_s = self.ttft[r], latency
      if self.on_done is not None:
        self.on_done(r, self.results[r])
    self.finished.clear()


def _drained(eng, state) -> tuple:
  """What a chunk's drain copies (ring_lib.Drain.start): the ring, the step, the rows' done
  flags and step counts, and for adaptive k each row's acceptance counts (priors.py)."""
  rows = state.rows
  counts = (rows.cond_trials, rows.cond_hits) if eng.cfg.adaptive else ()
  return (state.record.ring, state.record.step, rows.done, rows.steps) + counts


def _find_stop(text: str, stops) -> tuple[int, str | None]:
  """-> (index of the earliest stop string in text, that string), or (-1, None)."""
  best, which = -1, None
  for s in stops:
    i = text.find(s)
    if i >= 0 and (best < 0 or i < best):
      best, which = i, s
  return best, which
