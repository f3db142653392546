"""mtp-train: train a model with MTP heads (joint) or add heads to a frozen trunk (heads_only).

  mtp-train --config=configs/demo.py --workdir=DIR [--config.train.steps=N ...] [--mesh=data:2,model:4]

Rerunning with the same --workdir resumes from its last checkpoint. The flags, the config file,
its overrides and the workdir are checked before JAX is imported: a mistake fails at once, in
one line naming the flag and the value.
"""

import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from mtp_jax import backend

from infer import checks, mesh_flags
from infer.progress import Progress

_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, metrics, model/.")
# config.MODES, spelled out so that flags parse before JAX is imported.
_MODE = flags.DEFINE_enum("mode", None, ["joint", "heads_only"],
                          "Shortcut for --config.train.mode.")
_QUIET = flags.DEFINE_bool("quiet", False, "No progress or log lines on stderr; errors only.")
flags.mark_flags_as_required(["config", "workdir"])


def _fail(msg: str):
  sys.stderr.write(f"mtp-train: error: {msg}\n")
  sys.exit(1)


def _config_dict() -> dict:
  try:
    return _CONFIG.value.to_dict()
  except (OSError, SyntaxError, AttributeError, ImportError) as e:
    _fail(f"--config={flags.FLAGS['config'].config_filename}: cannot be loaded "
          f"({str(e).splitlines()[-1].strip()})")


def _logger(quiet: bool):
  """-> (log, progress): plain timestamped lines when stderr is not a terminal; on a terminal a
  bar of steps with the loss, and the other log lines above it."""
  bar = {"p": None}

  def progress(step, steps, loss):
    if bar["p"] is None and not quiet and sys.stderr.isatty():
      bar["p"] = Progress(steps, "steps", desc="mtp-train")
      bar["p"].done = step - 1            # a resumed run starts where it left off
    if bar["p"] is not None:
      bar["p"].update(step, loss=loss)

  def log(msg: str):
    if quiet:
      return
    if bar["p"] is not None:
      if not msg.startswith("step "):     # the bar shows the periodic step lines' content
        bar["p"].write(time.strftime("%H:%M:%S ") + msg)
      return
    sys.stderr.write(time.strftime("%H:%M:%S ") + msg + "\n")
    sys.stderr.flush()
  return log, progress, bar


def main(argv):
  del argv
  try:
    checks.output_dir("workdir", _WORKDIR.value)
  except checks.FlagError as e:
    _fail(str(e))
  d = _config_dict()
  if _MODE.value:
    d["train"]["mode"] = _MODE.value
  if mesh_flags.MESH.value is not None:
    d["mesh"]["shape"] = mesh_flags.MESH.value
  from mtp_jax import config as config_lib
  from mtp_jax.formats import cache_dir
  from mtp_jax.training import trainer as train_lib
  cache_dir.enable_compilation_cache()          # a rerun or a resume loads its programs
  log, progress, bar = _logger(_QUIET.value)
  try:
    if d["train"].get("init_from"):
      checks.model_dir("config.train.init_from", d["train"]["init_from"])
      # The run continues that model: its trunk's config is the run's, whatever the file says.
      d["model"] = train_lib.init_from_model_section(d["train"]["init_from"])
    cfg = config_lib.Config.from_dict(d)
    mesh_flags.initialize()
    result = train_lib.train(cfg, _WORKDIR.value, log=log, progress=progress)
  except (config_lib.ConfigError, ValueError, FileNotFoundError, train_lib.TrainingDiverged) as e:
    _fail(str(e))
  finally:
    if bar["p"] is not None:
      bar["p"].close()
  log(f"final evaluation: {result}")


def run():
  backend.apply_defaults()            # before JAX starts a backend
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  app.run(main, flags_parser=checks.flags_parser("mtp-train"))


if __name__ == "__main__":
  run()
