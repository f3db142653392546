"""Defaults of every field, from the dataclasses in mtp_jax/config.py, as an ml_collections
ConfigDict so that the CLI can override any field (`--config.train.steps=10`)."""

import dataclasses

import ml_collections

from mtp_jax import config as config_lib


def get_config():
  return ml_collections.ConfigDict(
      {f.name: dataclasses.asdict(f.default) for f in dataclasses.fields(config_lib.Config)})
