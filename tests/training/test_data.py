"""Tokenizer, split and batch iterator: deterministic and resumable."""

import numpy as np
import pytest

from mtp_jax.formats import tokenizer as T
from mtp_jax.training import data as D
from tests.conftest import tiny_config


def test_split_is_deterministic_and_disjoint():
  cfg = tiny_config().data
  tr1, he1 = D.split_files(cfg)
  tr2, he2 = D.split_files(cfg)
  assert (tr1, he1) == (tr2, he2)
  assert he1 and tr1 and not set(tr1) & set(he1)
  # The split of a file depends on its path alone, not on which other files exist.
  assert all(D.is_heldout(f, cfg.heldout_permille) for f in he1)


def test_missing_corpus_is_named():
  with pytest.raises(FileNotFoundError, match="data.corpus_dir='/nonexistent'"):
    D.list_files(tiny_config(data={"corpus_dir": "/nonexistent"}).data)
  with pytest.raises(FileNotFoundError, match="data.glob='\\*\\*/\\*.nothing'"):
    D.list_files(tiny_config(data={"glob": "**/*.nothing"}).data)


def test_bpe_round_trip_and_special_tokens(tmp_path):
  cfg = tiny_config().data
  tr, _ = D.split_files(cfg)
  tok = T.train_bpe(D.iter_texts(cfg, tr), 400)
  assert tok.vocab_size <= 400 and tok.eod_id is not None and tok.pad_id != tok.eod_id
  text = "def f(x):\n    return {'a': x ** 2}  # ünïcode ✓\n"
  assert tok.decode(tok.encode(text)) == text
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  tok2 = T.Tokenizer.load(path)
  assert tok2.encode(text) == tok.encode(text)
  stream = D.tokenize_files(cfg, tr, tok)
  assert (stream == tok.eod_id).sum() == len(tr)


def test_bad_tokenizer_file_is_named(tmp_path):
  p = tmp_path / "tokenizer.json"
  p.write_text("{not json")
  with pytest.raises(ValueError, match="tokenizer.json: not a valid tokenizer.json"):
    T.Tokenizer.load(str(p))


def test_iterator_is_a_function_of_its_state():
  tokens = np.arange(1000, dtype=np.int32)
  it = D.BatchIterator(tokens, batch_size=4, window=10, seed=3)
  first = [next(it) for _ in range(70)]      # crosses epochs (111 windows / 4 per batch)
  it2 = D.BatchIterator(tokens, batch_size=4, window=10, seed=3)
  it2.restore({"next_batch": 50, "seed": 3})
  np.testing.assert_array_equal(next(it2), first[50])
  assert all(b.shape == (4, 10) for b in first)
  # Within an epoch every window appears once.
  epoch0 = np.concatenate(first[:27])[:, 0]
  assert len(set(epoch0.tolist())) == len(epoch0)
  it3 = D.BatchIterator(tokens, batch_size=4, window=10, seed=4)
  assert not np.array_equal(next(it3), first[0])
