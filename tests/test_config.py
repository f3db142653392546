"""Bad configuration values are rejected with the field and the value named."""

import pytest

from mtp_jax import config as C
from tests.conftest import tiny_config


@pytest.mark.parametrize("section, fields, field_named", [
    ("model", {"d_model": 64, "n_heads": 5}, "model.n_heads=5"),
    ("model", {"n_heads": 4, "n_kv_heads": 3}, "model.n_kv_heads=3"),
    ("model", {"vocab_size": 0}, "model.vocab_size=0"),
    ("model", {"param_dtype": "float8"}, "model.param_dtype='float8'"),
    ("model", {"d_model": 60, "n_heads": 4}, "model.n_heads=4"),   # head dim 15 is odd
    ("heads", {"num": 0}, "heads.num=0"),
    ("heads", {"kind": "tree"}, "heads.kind='tree'"),
    ("train", {"lr": -1.0}, "train.lr=-1.0"),
    ("train", {"mode": "full"}, "train.mode='full'"),
    ("train", {"mode": "heads_only", "init_from": ""}, "train.init_from=''"),
    ("data", {"heldout_permille": 1000}, "data.heldout_permille=1000"),
    ("data", {"seq_len": 1000}, "data.seq_len=1000"),
    ("data", {"format": "csv"}, "data.format='csv'"),
    ("data", {"format": "jsonl"}, "data.path=''"),
    ("data", {"path": "chats.jsonl"}, "data.path='chats.jsonl'"),
    ("data", {"format": "jsonl", "path": "c.jsonl", "corpus_dir": "c.jsonl"},
     "data.corpus_dir='c.jsonl'"),
    ("data", {"format": "jsonl", "path": "c.jsonl", "max_files": 3}, "data.max_files=3"),
])
def test_bad_values_name_the_field(section, fields, field_named):
  with pytest.raises(C.ConfigError) as e:
    tiny_config(**{section: fields})
  assert field_named in str(e.value)


def test_wrong_type_and_unknown_field_are_named():
  with pytest.raises(C.ConfigError, match=r"train.steps='10': must be of type int"):
    tiny_config(train={"steps": "10"})
  with pytest.raises(C.ConfigError, match="unknown field.*model.*d_modle"):
    C.Config.from_dict({"model": {"d_modle": 3}})


def test_round_trip_and_frozen():
  cfg = tiny_config()
  assert C.Config.from_dict(cfg.to_dict()) == cfg
  with pytest.raises(Exception):
    cfg.model.d_model = 3
  m, h = C.load_model_dir_config(__import__("json").dumps(C.model_dir_config(cfg)))
  assert (m, h) == (cfg.model, cfg.heads)


def test_heads_only_chat_config_needs_a_jsonl_path():
  from configs import heads_only_chat
  d = heads_only_chat.get_config().to_dict()
  d["train"]["init_from"] = "MODEL_DIR"
  d["model"]["max_seq_len"] = 1024
  with pytest.raises(C.ConfigError, match="data.path='': must name a JSONL file"):
    C.Config.from_dict(d)
  d["data"]["path"] = "chats.jsonl"
  cfg = C.Config.from_dict(d)
  assert cfg.data.format == "jsonl" and cfg.train.mode == "heads_only"
