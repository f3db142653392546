"""The host's side of a decoder's run: the slots' requests, token streams and completions."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.decoding import engine as engine_lib
from mtp_jax.decoding import ring as ring_lib


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


class Slots:
  """The host's side of a run: which request each slot serves, the queue of waiting requests,
  the rows' token streams, and the finished completions."""

  def __init__(self, dec, eng, requests: Sequence[Request], on_done, t_start: float):
    """dec: the api.Decoder; eng: the engine that runs them (the decoder's, or its plain one:
    Decoder.run); t_start: the run's start (perf_counter)."""
    b = eng.cfg.batch_size
    self.dec, self.eng, self.requests, self.on_done = dec, eng, requests, on_done
    self.t_start = t_start
    self.wait = 0.0                    # seconds blocked on the device (for host overhead)
    self.first_step: float | None = None   # the host holds the first decode step's tokens
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
      elif self.requests[r].stop and find_stop(self.dec.tokenizer.decode(self.streams[slot]),
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


def first_timed(finish, slots: "Slots"):
  """finish, noting in slots.first_step when the first one returned (from the run's start)."""
  def timed():
    out = finish()
    if slots.first_step is None:
      slots.first_step = time.perf_counter() - slots.t_start
    return out
  return timed


def drained(eng, state) -> tuple:
  """What a chunk's drain copies (ring_lib.Drain.start): the ring, the step, the rows' done
  flags and step counts, and for adaptive k each row's acceptance counts (priors.py)."""
  rows = state.rows
  counts = ((rows.cond_trials, rows.cond_hits, state.controller.wanted) if eng.cfg.adaptive
            else ())
  return (state.record.ring, state.record.step, rows.done, rows.steps) + counts


def find_stop(text: str, stops) -> tuple[int, str | None]:
  """-> (index of the earliest stop string in text, that string), or (-1, None)."""
  best, which = -1, None
  for s in stops:
    i = text.find(s)
    if i >= 0 and (best < 0 or i < best):
      best, which = i, s
  return best, which
