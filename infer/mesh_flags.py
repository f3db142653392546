"""Flags shared by mtp-train, mtp-infer and mtp-bench: the device mesh and multi-host start.

  --mesh=data:2,model:4                   the ('data', 'model') mesh over the visible devices
  --coordinator_address=HOST:PORT --num_processes=N --process_id=I
                                          one process per host, before JAX touches a device
"""

from absl import flags

MESH = flags.DEFINE_string("mesh", None, "Device mesh, e.g. data:2,model:4 ('' = every device on "
                           "'data'). Unset: one device (mtp-infer, mtp-bench) or "
                           "--config.mesh.shape (mtp-train).")
COORDINATOR = flags.DEFINE_string("coordinator_address", "", "Multi-host: HOST:PORT of process 0.")
NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Multi-host: number of processes.")
PROCESS_ID = flags.DEFINE_integer("process_id", 0, "Multi-host: this process's index.")


def initialize():
  """Starts jax.distributed when a coordinator is given (call first in main)."""
  from mtp_jax import sharding
  sharding.initialize_distributed(COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
