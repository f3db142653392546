"""The Python API: load a model directory, generate for a list of prompts.

  from mtp_jax import api
  dec = api.Decoder.load("pretrained/demo", batch_size=8, k=3)
  for c in dec.generate(["def f(x):\\n"], max_new_tokens=64):
    print(c.text, c.acceptance_length)

Prompts are served from a queue into the engine's slots (continuous batching): whenever a row
finishes, the slot is refilled by prefill + insert between generate calls.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import engine as engine_lib
from mtp_jax import ring as ring_lib
from mtp_jax.config import DecodeConfig


@dataclasses.dataclass
class Completion:
  text: str
  token_ids: list[int]
  finish_reason: str          # 'stop' (end token) or 'length' (max_new_tokens or full context)
  prompt_tokens: int
  steps: int                  # decode steps (the first token comes from prefill)
  acceptance_length: float    # tokens emitted per decode step


@dataclasses.dataclass
class Request:
  prompt_ids: list[int]
  max_new_tokens: int = 128
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  repetition_penalty: float = 1.0


class Decoder:
  def __init__(self, model_cfg, heads_cfg, params, tokenizer, decode_cfg: DecodeConfig,
               seed: int = 0):
    self.tokenizer, self.params = tokenizer, params
    self.engine = engine_lib.Engine(model_cfg, heads_cfg, decode_cfg, tokenizer.eod_id)
    self.seed = seed
    self.last_stats: dict = {}

  @classmethod
  def load(cls, model_dir: str, batch_size: int = 8, k: int | str = -1, max_len: int = 0,
           ring_size: int = 32, seed: int = 0, **decode_options) -> "Decoder":
    """k: drafts per step (-1 all heads, 0 plain decoding) or 'auto' (adaptive, up to all
    heads). decode_options: other DecodeConfig fields (confidence_threshold, ...)."""
    mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(model_dir)
    adaptive = k == "auto"
    dcfg = DecodeConfig(batch_size=batch_size, k=-1 if adaptive else int(k), max_len=max_len,
                        ring_size=ring_size, adaptive=adaptive, **decode_options)
    return cls(mcfg, hcfg, params, tok, dcfg, seed)

  def calibrate(self, table_path: str | None = None, force: bool = False) -> list[float]:
    """Cost table of the adaptive controller (see Engine.calibrate)."""
    return self.engine.calibrate(self.params, table_path, force)

  def warmup(self, max_prompt_len: int | None = None) -> int:
    """Compiles every shape serving can meet (see Engine.warmup)."""
    return self.engine.warmup(self.params, max_prompt_len)

  def generate(self, prompts: Sequence[str], max_new_tokens: int = 128, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0,
               repetition_penalty: float = 1.0) -> list[Completion]:
    reqs = [Request(self.tokenizer.encode(p), max_new_tokens, temperature, top_k, top_p,
                    repetition_penalty) for p in prompts]
    return self.run(reqs)

  def run(self, requests: Sequence[Request], on_done=None) -> list[Completion]:
    """Decodes every request; results in request order. `on_done(index, completion)` is called
    as each request finishes (in finishing order), for streaming output."""
    eng = self.engine
    b = eng.cfg.batch_size
    state = eng.init_state(self.seed)
    key = jax.random.key(self.seed + 1)
    drain = ring_lib.Drain()
    queue = list(range(len(requests)))[::-1]
    slot_req = [-1] * b
    streams: list[list[int]] = [[] for _ in range(b)]
    results: list[Completion | None] = [None] * len(requests)
    sampled = np.zeros((b,), bool)
    free = list(range(b))[::-1]

    def fill(state, key):
      while free and queue:
        slot, r = free.pop(), queue.pop()
        req = requests[r]
        key, sub = jax.random.split(key)
        prefix = eng.prefill(self.params, [req.prompt_ids], sub, [req.temperature], [req.top_k],
                             [req.top_p], [req.repetition_penalty])
        state = eng.insert(prefix, state, [slot], [req.max_new_tokens], [req.temperature],
                           [req.top_k], [req.top_p], [req.repetition_penalty])
        slot_req[slot] = r
        streams[slot] = [int(prefix.first[0])]
        sampled[slot] = engine_lib.needs_sampling(req.temperature, req.repetition_penalty)
      return state, key

    def collect(records):
      """Appends a drained chunk to the streams; finishes rows that are done."""
      tokens, emitted, _, _, done, row_steps = records
      ring_lib.append_streams(streams, tokens, emitted)
      for slot in range(b):
        r = slot_req[slot]
        if r < 0 or not done[slot]:
          continue
        results[r] = self._finish(requests[r], streams[slot], int(row_steps[slot]))
        if on_done is not None:
          on_done(r, results[r])
        slot_req[slot] = -1
        free.append(slot)

    # While requests wait, a finished row is refilled right after its chunk, so the host reads
    # each chunk before launching the next. Once the queue is empty nothing needs refilling: the
    # next chunk is launched first and the previous one drained while the device runs it.
    state, key = fill(state, key)
    while any(r >= 0 for r in slot_req):
      sample = bool(np.any(sampled & (np.asarray(slot_req) >= 0)))
      state = eng.generate(self.params, state, sample=sample)
      if drain.pending:
        collect(drain.finish())
      drain.start(state.ring, state.step, state.done, state.row_steps)
      if queue or not any(r >= 0 for r in slot_req):
        collect(drain.finish())
        state, key = fill(state, key)
    if drain.pending:
      collect(drain.finish())
    self.last_stats = engine_lib.stats(state)
    return results

  def _finish(self, req: Request, ids: list[int], steps: int) -> Completion:
    eod = self.tokenizer.eod_id
    reason = "length"
    if eod in ids:
      ids, reason = ids[: ids.index(eod)], "stop"
    emitted = len(ids) + (reason == "stop") - 1          # tokens from decode steps
    return Completion(text=self.tokenizer.decode(ids), token_ids=ids, finish_reason=reason,
                      prompt_tokens=len(req.prompt_ids), steps=steps,
                      acceptance_length=emitted / steps if steps else 0.0)
