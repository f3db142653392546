"""On-device ring buffer of the last R decode steps, and its host-side drain.

Each step writes one record at slot (step % R): per row the emitted tokens (up to k_max + 1), how
many of them are valid, how many drafts were verified and accepted; per step the k used and the
number of active rows (the adaptive controller reads the window of acceptance counts). `generate`
runs at most R steps per call, so the host can copy a whole call's records and rebuild every row's token
stream exactly, whatever the wrap-around.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class Ring:
  tokens: jax.Array      # [R, B, K+1] int32
  emitted: jax.Array     # [R, B] int32: valid tokens of the row in that step (0 if inactive)
  verified: jax.Array    # [R, B] int32: drafts verified for the row (0 if inactive)
  accepted: jax.Array    # [R, B] int32: drafts accepted for the row
  k_used: jax.Array      # [R] int32
  active: jax.Array      # [R] int32: rows active in that step

  @property
  def capacity(self) -> int:
    return self.tokens.shape[0]


def init_ring(capacity: int, batch_size: int, k_max: int) -> Ring:
  return Ring(tokens=jnp.zeros((capacity, batch_size, k_max + 1), jnp.int32),
              emitted=jnp.zeros((capacity, batch_size), jnp.int32),
              verified=jnp.zeros((capacity, batch_size), jnp.int32),
              accepted=jnp.zeros((capacity, batch_size), jnp.int32),
              k_used=jnp.zeros((capacity,), jnp.int32),
              active=jnp.zeros((capacity,), jnp.int32))


def record(ring: Ring, step, tokens_BK1, emitted_B, verified_B, accepted_B, k_used,
           active) -> Ring:
  i = step % ring.capacity
  pad = ring.tokens.shape[2] - tokens_BK1.shape[1]
  tokens = jnp.pad(tokens_BK1, ((0, 0), (0, pad)))
  return Ring(tokens=ring.tokens.at[i].set(tokens), emitted=ring.emitted.at[i].set(emitted_B),
              verified=ring.verified.at[i].set(verified_B),
              accepted=ring.accepted.at[i].set(accepted_B),
              k_used=ring.k_used.at[i].set(k_used), active=ring.active.at[i].set(active))


# Copies of the arrays a drain reads, made in one compiled call (the state they come from is
# donated to the next generate call while the host reads them).
_snapshot = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class Drain:
  """Host side: rebuilds each row's token stream from ring snapshots.

  `start(ring, step, *extra)` copies the ring (and any small arrays the host also needs, such as
  done flags) on the device, so that the state can be donated to the next `generate` call, and
  starts their asynchronous device-to-host transfer; `finish()` waits for it and returns the
  records of the steps since the previous drain, oldest first, as (tokens [n, B, K+1],
  emitted [n, B], k_used [n], active [n]) followed by the extra arrays on the host.
  `step` is the device's count of steps run in all (a device scalar; it is read in finish()).
  """

  def __init__(self):
    self.drained_step = 0
    self._pending = None

  def start(self, ring: Ring, step, *extra):
    snap = _snapshot((ring, step, extra))
    for x in jax.tree.leaves(snap):
      x.copy_to_host_async()
    self._pending = snap

  @property
  def pending(self) -> bool:
    return self._pending is not None

  def finish(self):
    ring, step, extra = jax.device_get(self._pending)
    self._pending = None
    step = int(step)
    r = ring.tokens.shape[0]
    if step - self.drained_step > r:
      raise RuntimeError(f"ring overrun: {step - self.drained_step} steps since the last drain "
                         f"but capacity is {r}")
    idx = np.arange(self.drained_step, step) % r
    self.drained_step = step
    return (ring.tokens[idx], ring.emitted[idx], ring.k_used[idx], ring.active[idx]) + tuple(extra)

  def drain(self, ring: Ring, step, *extra):
    self.start(ring, step, *extra)
    return self.finish()


def append_streams(streams: list[list[int]], tokens, emitted):
  """Appends each row's valid tokens of the drained steps to streams[row]."""
  for s in range(tokens.shape[0]):
    for b in np.nonzero(emitted[s])[0]:
      streams[b].extend(tokens[s, b, : emitted[s, b]].tolist())
