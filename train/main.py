"""mtp-train: train a model with MTP heads (joint) or add heads to a frozen trunk (heads_only).

  mtp-train --config=configs/demo.py --workdir=DIR [--config.train.steps=N ...] [--mesh=data:2,model:4]

Rerunning with the same --workdir resumes from its last checkpoint.
"""

import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from infer import mesh_flags
from mtp_jax import config as config_lib
from mtp_jax import train_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, model/.")
_MODE = flags.DEFINE_enum("mode", None, list(config_lib.MODES), "Shortcut for --config.train.mode.")
flags.mark_flags_as_required(["config", "workdir"])


def _log(msg: str):
  sys.stderr.write(time.strftime("%H:%M:%S ") + msg + "\n")
  sys.stderr.flush()


def main(argv):
  del argv
  d = _CONFIG.value.to_dict()
  if _MODE.value:
    d["train"]["mode"] = _MODE.value
  if mesh_flags.MESH.value is not None:
    d["mesh"]["shape"] = mesh_flags.MESH.value
  try:
    mesh_flags.initialize()
    if d["train"].get("init_from"):
      # The run continues that model: its trunk's config is the run's, whatever the file says.
      d["model"] = train_lib.init_from_model_section(d["train"]["init_from"])
    cfg = config_lib.Config.from_dict(d)
    result = train_lib.train(cfg, _WORKDIR.value, log=_log)
  except (config_lib.ConfigError, ValueError, FileNotFoundError, train_lib.TrainingDiverged) as e:
    sys.stderr.write(f"mtp-train: error: {e}\n")
    sys.exit(1)
  _log(f"final evaluation: {result}")


def run():
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  app.run(main)


if __name__ == "__main__":
  run()
