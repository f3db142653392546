"""Progress of the command-line tools on stderr: a live tqdm bar on a terminal, a plain line
every `every_s` seconds (and at the end) when stderr is a file or a pipe, nothing when quiet.

  bar = Progress(total=64, unit="rows", quiet=False)
  bar.update(done=8, tokens_per_s=812.0, acceptance_length=2.31)   # absolute count, postfix
  bar.write("a line that must not break the bar")
  bar.close()
"""

import os
import sys
import time

from tqdm import tqdm


class Progress:

  def __init__(self, total: int, unit: str, quiet: bool = False, desc: str = "",
               every_s: float = 10.0, stream=None):
    self.total, self.unit, self.desc, self.every_s = total, unit, desc, every_s
    self.stream = stream or sys.stderr
    self.quiet = quiet
    self.done, self.post = 0, {}
    self._t0 = time.perf_counter()
    self._last_line = self._t0
    self._bar = None
    if not quiet and self.stream.isatty():
      # A terminal that reports no width (a bare pseudo-terminal) would get an empty bar.
      wide = _width(self.stream) > 0
      self._bar = tqdm(total=total, unit=f" {unit}", desc=desc or None, file=self.stream,
                       dynamic_ncols=wide, ncols=None if wide else 100,
                       nrows=None if wide else 20, smoothing=0.1)

  def _postfix(self) -> str:
    return ", ".join(f"{k.replace('_per_s', '/s').replace('_', ' ')} {_fmt(v)}"
                     for k, v in self.post.items())

  def update(self, done: int, **postfix):
    """`done`: the count so far (not an increment); postfix: named values shown beside it."""
    self.post.update(postfix)
    delta, self.done = done - self.done, done
    if self.quiet:
      return
    if self._bar is not None:
      self._bar.set_postfix_str(self._postfix(), refresh=False)
      self._bar.update(delta)
      return
    now = time.perf_counter()
    if now - self._last_line >= self.every_s or done >= self.total:
      self._last_line = now
      self.stream.write(self.line(now) + "\n")
      self.stream.flush()

  def line(self, now: float | None = None) -> str:
    """The plain progress line: count, rate-derived ETA and the postfix."""
    el = (now or time.perf_counter()) - self._t0
    rate = self.done / el if el > 0 else 0.0
    eta = (self.total - self.done) / rate if rate > 0 else float("nan")
    head = f"{self.desc}: " if self.desc else ""
    post = self._postfix()
    return (f"{head}{self.done}/{self.total} {self.unit}, {el:.0f}s elapsed, ETA {eta:.0f}s"
            + (f", {post}" if post else ""))

  def write(self, msg: str):
    """A log line: above the bar on a terminal, as is otherwise; dropped when quiet."""
    if self.quiet:
      return
    if self._bar is not None:
      self._bar.write(msg, file=self.stream)
    else:
      self.stream.write(msg + "\n")
      self.stream.flush()

  def close(self):
    if self._bar is not None:
      self._bar.close()
      self._bar = None


def _width(stream) -> int:
  try:
    return os.get_terminal_size(stream.fileno()).columns
  except (OSError, ValueError, AttributeError):
    return 0


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"
  return str(v)
