"""When a batch job refills its slots: the host's clock of refill gaps and step times."""

from __future__ import annotations

import time


class RefillClock:
  """How long freed slots may stand idle while requests wait. A refill stops the device for F
  seconds (drain, prefill, insert, relaunch); a slot idle for a step costs 1/B of a step of s
  seconds. Refilling once the freed slots' idle slot-steps reach B x F / s costs at most twice
  what the best schedule in hindsight would (the ski-rental rule); F and s are this run's own
  means so far (0 before the first refill: refill at the first freed slot)."""

  def __init__(self, b: int):
    self.b, self.gap_s, self.refills, self.chunk_s, self.steps = b, 0.0, 0, 0.0, 0
    self.t_launch = self.t_ready = None

  def launch(self):
    now = time.perf_counter()
    if self.t_ready is not None:          # the device stood still since the last chunk ended
      self.gap_s += now - self.t_ready
      self.refills += 1
      self.t_ready = None
    self.t_launch = now

  def chunk_done(self, steps: int, refilling: bool):
    now = time.perf_counter()
    self.chunk_s += now - self.t_launch
    self.steps += steps
    self.t_ready = now if refilling else None

  def idle_steps(self) -> float:
    if not self.refills or not self.steps:
      return 0.0
    return self.b * (self.gap_s / self.refills) / (self.chunk_s / self.steps)
