"""Adaptive k's generate programs, compiled behind the run: decoding never waits for a new shape.

A program of adaptive k holds a loop per shape it may run (loop.py), and compiling it takes
seconds per shape: on a 214 MB model on 2 CPU cores, 1.6 s for a fixed chain of 3 drafts, 5.7 s
for plain decoding, its probe and the chain of 3 under the controller. Where a program the
engine wants (Engine.ks, for greedy or sampled rows) is not compiled yet, it is compiled on a
thread, and the call runs the largest program already compiled whose shapes it holds; with none,
a program of the largest opened shape alone (loop.Loop.adaptive: no controller), compiled at
once. So the first decode step waits for the smallest program, and a shape the controller opens
later (costs.Learner) joins once its program is ready. Host side.
"""

from __future__ import annotations

import concurrent.futures

import jax


def _spec(x):
  """The abstract value a program is compiled for (x may be donated before the thread lowers)."""
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return x


class Programs:
  """The compiled generate programs of one engine: (sample, ks) -> an executable, or the future
  of one being compiled."""

  def __init__(self, jitted):
    """jitted: the engine's jitted generate (static arguments sample and ks)."""
    self.jitted = jitted
    self.ready: dict = {}
    self.pending: dict = {}
    self._pool = None

  def _compile(self, specs, sample: bool, ks: tuple[int, ...]):
    return self.jitted.lower(*specs, sample=sample, ks=ks).compile()

  def compile_now(self, args, sample: bool, ks: tuple[int, ...]):
    key = (sample, ks)
    if key not in self.ready:
      self.ready[key] = self._compile(jax.tree.map(_spec, args), sample, ks)
    return self.ready[key]

  def run(self, args, sample: bool, ks: tuple[int, ...]):
    """Runs the call (args: the jitted generate's positional arguments) with program ks if it
    is compiled, else with the largest compiled one whose shapes ks holds (or ks's largest shape
    alone, compiled now), ks compiling meanwhile on a thread."""
    key = (sample, ks)
    self._collect()
    if key not in self.ready:
      if key not in self.pending:
        if self._pool is None:
          self._pool = concurrent.futures.ThreadPoolExecutor(1, "mtp-jax-compile")
        self.pending[key] = self._pool.submit(self._compile, jax.tree.map(_spec, args), sample,
                                              ks)
      have = [k for (s, k) in self.ready if s == sample and set(k) <= set(ks)]
      ks = max(have, key=len) if have else (max(ks),)
    return self.compile_now(args, sample, ks)(*args)

  @property
  def busy(self) -> bool:
    """Whether a program is being compiled (a call beside it runs slower than its steps cost)."""
    self._collect()
    return bool(self.pending)

  def _collect(self):
    for key, fut in list(self.pending.items()):
      if fut.done():
        self.ready[key] = fut.result()
        del self.pending[key]

  def wait(self):
    """Waits for the programs being compiled."""
    for fut in list(self.pending.values()):
      fut.result()
    self._collect()
