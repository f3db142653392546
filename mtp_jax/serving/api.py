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
import numpy as np

from mtp_jax import config as config_lib
from mtp_jax import sharding as sharding_lib
from mtp_jax.config import DecodeConfig
from mtp_jax.decoding import costs as costs_lib
from mtp_jax.decoding import engine as engine_lib
from mtp_jax.decoding import priors as priors_lib
from mtp_jax.decoding import ring as ring_lib
from mtp_jax.decoding import shape_set, shapes, tables
from mtp_jax.decoding import state as state_lib
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.serving import refill as refill_lib
from mtp_jax.serving import slots as slots_lib
from mtp_jax.serving.slots import Completion, Request  # noqa: F401  (the API's types)


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
    # Adaptive k's host side (costs.Learner): the step costs learned from the calls, the shapes
    # compiled; where they are kept (cost_table).
    self.learner: costs_lib.Learner | None = None
    self.table_path: str | None = None
    self._fresh = False

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

  def cost_table(self, path: str | None = None, fresh: bool = False):
    """Keeps adaptive k's learned step costs in the tables file at path (default
    ~/.cache/mtp_jax/cost_tables.json), a later process starting from them (fresh: from the
    roofline instead), and the acceptance per draft position this model's runs measure
    (tables.rates_key): a later process starts from it where the heads' confidence alone would
    be its only guide. Without it both are learned anew by each process."""
    if not self.engine.cfg.adaptive:
      return
    self.table_path, self._fresh = path or tables.default_table_path(), fresh
    self.learner = None
    self.priors.path = self.table_path
    if self._fingerprint is None:
      self._fingerprint = tables.params_fingerprint(self.params)
    self.priors.keys = {s: tables.rates_key(self.engine, self._fingerprint, s)
                        for s in (False, True)}

  def fix_costs(self, cost):
    """Adaptive k weighs these costs per shape throughout, every shape compiled: nothing is
    learned (a controlled setting, for tests)."""
    self.engine.cost, self.learner = list(cost), False
    self.engine.opened = set(range(1, self.engine.n_shapes))

  def _learn(self) -> costs_lib.Learner | None:
    """Adaptive k's learner, made at first need: its costs from the stored table or the
    roofline, its first shape from the prior's rates (None: fixed costs, or not adaptive)."""
    if self.learner is False:
      return None
    if self.engine.cfg.adaptive and self.learner is None:
      self.learner = costs_lib.Learner(self.engine, self.params, self.table_path, self._fresh,
                                       self.priors.start(False)[0])
    return self.learner

  def warmup(self, max_prompt_len: int | None = None) -> int:
    """Compiles every shape serving can meet (see Engine.warmup), the copy a chunk's drain
    makes of the ring and the rows' key folding, so that the first run compiles nothing.
    -> the number of buckets."""
    self._learn()
    n = self.engine.warmup(self.params, max_prompt_len)
    if self.plain is not None:     # a run adaptive k's costs show can never draft
      self.plain.warmup(self.params, max_prompt_len)
      ring_lib.Drain().drain(*slots_lib.drained(self.plain, self.plain.init_state()))
    ring_lib.Drain().drain(*slots_lib.drained(self.engine, self.engine.init_state()))
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
    learner = self._learn()
    if learner is not None:
      learner.run_started()
    prior = self.priors.start(sampled_run) if eng.cfg.adaptive else (None, None)
    if eng.stays_plain(*prior):
      eng, prior = self.plain, (None, None)
    slots = slots_lib.Slots(self, eng, requests, on_done, t_start)
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
    if learner is not None:
      learner.save()
    self.last_timing = {"wall_s": time.perf_counter() - slots.t_start, "wait_s": slots.wait,
                        "first_step_s": slots.first_step}
    return slots.results

  def _decode(self, state, slots: "slots_lib.Slots"):
    """The chunk loop: generate, hand over, drain, refill, until every request is done.

    While requests wait, a finished row is refilled right after its chunk, so the host reads
    each chunk before launching the next. Once the queue is empty nothing needs refilling: the
    next chunk is launched first and the previous one drained while the device runs it, unless
    the chunk in flight ends every row (_Slots.finish_within): then nothing more is launched."""
    eng, learner = slots.eng, self.learner or None
    drain = ring_lib.Drain()
    if learner is not None:       # each call's time and shapes teach adaptive k's costs
      finish = lambda: learner.drained(eng, drain.finish)
    elif eng.cfg.adaptive:        # the controller's wishes (last) serve a learner alone
      finish = lambda: drain.finish()[:-1]
    else:
      finish = drain.finish
    finish = slots_lib.first_timed(finish, slots)
    clock = refill_lib.RefillClock(eng.cfg.batch_size)
    chunk = eng.cfg.ring_size           # steps a chunk may run (the ring holds them all)
    state = slots.fill(state)
    while slots.busy():
      if drain.pending and not slots.queue and slots.finish_within(chunk):
        slots.collect(slots.timed(finish))   # the chunk in flight ends every row
        continue
      state = slots.apply_cancel(state)
      # While requests wait, the chunk ends once every waiting request has a free slot, or once
      # the freed slots' idleness outweighs a refill's cost (refill.py).
      clock.launch()
      if learner is not None:
        state = self._costs_to(eng, state)
      state = eng.generate(self.params, state, chunk, sample=slots.sampling(),
                           refill=min(len(slots.queue), eng.cfg.batch_size),
                           idle_steps=clock.idle_steps(), closed=not slots.queue)
      if learner is not None:
        learner.launched()
      slots.hand_over()                 # detokenise and write while the chunk runs
      if drain.pending:
        slots.collect(slots.timed(finish))
      drain.start(*slots_lib.drained(eng, state))
      if slots.queue or not slots.busy():
        step0 = drain.drained_step
        slots.collect(slots.timed(finish))
        clock.chunk_done(drain.drained_step - step0, refilling=bool(slots.queue))
        state = slots.fill(slots.apply_cancel(state))   # before a new request takes the slot
    if drain.pending:
      slots.collect(slots.timed(finish))
    slots.hand_over()
    return state

  def _costs_to(self, eng, state):
    """state with the controller's costs as learned so far (adaptive engines)."""
    if not eng.cfg.adaptive:
      return state
    cost = eng.cost_array(eng.cost)
    if getattr(self, "_put_cost", None) is None or not np.array_equal(self._put_cost, cost):
      self._put_cost = cost
      return eng.put(state, cost=cost)
    return state

  def _finish(self, req: Request, ids: list[int], steps: int) -> Completion:
    reason = "length"
    emitted = len(ids) - 1                               # tokens from decode steps
    ends = [i for i, t in enumerate(ids) if t in self.tokenizer.end_ids]
    if ends:
      ids, reason = ids[: ends[0]], "stop"
    text = self.tokenizer.decode(ids)
    cut, stop = slots_lib.find_stop(text, req.stop)
    if cut >= 0:
      # Keep the tokens up to the one that completed the stop string; the text ends before it.
      lo, hi = 1, len(ids)
      while lo < hi:
        mid = (lo + hi) // 2
        if slots_lib.find_stop(self.tokenizer.decode(ids[:mid]), (stop,))[0] >= 0:
          hi = mid
        else:
          lo = mid + 1
      ids, text, reason = ids[:lo], text[:cut], "stop"
    return Completion(text=text, token_ids=ids, finish_reason=reason,
                      prompt_tokens=len(req.prompt_ids), steps=steps,
                      acceptance_length=emitted / steps if steps else 0.0)
