"""Sequential MTP heads (DeepSeek-V3 style modules): shifted inputs, training, exact speculative
decoding (greedy and sampled), no recompiles, and module caches equal to a full recomputation."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import config as config_lib
from mtp_jax.config import DecodeConfig, HeadsConfig
from mtp_jax.decoding import engine as E
from mtp_jax.decoding import state as state_lib
from mtp_jax.decoding.shape_set import resolve
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.models import cache as kv
from mtp_jax.models import model as model_lib
from mtp_jax.serving import api
from mtp_jax.training import trainer as train_lib
from tests.conftest import tiny_config
from tests.helpers import assert_same_distribution, compiles

PROMPTS = ["def f(x):\n    return x\n\ndef f(", "import os\nimport sys\nimport ", "class A:\n",
           "for i in range(10):\n    for i in range(", "x = 1\n"]


@pytest.fixture(scope="module")
def seq_model(trained_tiny, tmp_path_factory):
  """Sequential heads trained heads-only on the tiny trunk (the source has parallel heads)."""
  _, workdir, _ = trained_tiny
  out = str(tmp_path_factory.mktemp("seq_run"))
  cfg = tiny_config(heads={"kind": "sequential", "num": 3},
                    train={"mode": "heads_only", "init_from": os.path.join(workdir, "model"),
                           "steps": 30, "eval_every": 30, "checkpoint_every": 30,
                           "log_every": 5, "distill_source": "generated"})
  train_lib.train(cfg, out, log=lambda s: None)
  return ckpt_lib.load_model_dir(os.path.join(out, "model")), out


def test_module_inputs_are_shifted_tokens():
  """Module i at position t reads token t+i (and earlier ones), never a later one."""
  mcfg = config_lib.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                d_ff=64, max_seq_len=64)
  m = model_lib.create(mcfg, HeadsConfig(kind="sequential", num=3), seed=1)
  _, params = model_lib.split(m)
  params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(0), x.shape), params)
  m = model_lib.bind(model_lib.split(m)[0], params)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (1, 16)))
  h = jax.random.normal(jax.random.key(1), (1, 12, 32))
  base = np.asarray(m.head_hidden(h, tokens))                         # [1, 12, 3, D]
  t = 5
  for i in (1, 2, 3):
    changed = np.asarray(m.head_hidden(h, tokens.at[0, t + i].set((tokens[0, t + i] + 1) % 64)))
    assert not np.allclose(changed[0, t, i - 1], base[0, t, i - 1]), i     # reads token t+i
    later = np.asarray(m.head_hidden(h, tokens.at[0, t + i + 1].set(
        (tokens[0, t + i + 1] + 1) % 64)))
    np.testing.assert_array_equal(later[0, : t + 1, i - 1], base[0, : t + 1, i - 1])


def test_training_loss_is_nonzero_and_falls(seq_model):
  (mcfg, hcfg, params, tok), out = seq_model
  assert hcfg.kind == "sequential" and hcfg.num == 3
  import json
  recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))
          if '"train"' in line]
  for i in (1, 2, 3):
    losses = [r[f"head{i}_loss"] for r in recs]
    assert min(losses) > 0 and losses[-1] < losses[0], (i, losses)


def _decoder(model, **kw):
  mcfg, hcfg, params, tok = model
  return api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, ring_size=8, **kw))


@pytest.mark.parametrize("kw", [dict(k=1), dict(k=3), dict(k=5, reuse_module=True),
                                dict(k=3, adaptive=True)])
def test_greedy_output_equals_plain(seq_model, kw):
  model = seq_model[0]
  tok = model[3]
  reqs = [api.Request(tok.encode(p), n) for p, n in zip(PROMPTS, [30, 7, 25, 40, 18])]
  plain = _decoder(model, k=0).run(reqs)
  dec = _decoder(model, **kw)
  out = dec.run(reqs)
  assert [c.token_ids for c in out] == [c.token_ids for c in plain]
  assert sum(dec.last_stats["accepted"]) > 0, dec.last_stats


def test_module_caches_equal_full_recomputation(seq_model):
  (mcfg, hcfg, params, tok), _ = seq_model
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=2, k=3, ring_size=8), tok.eod_id)
  prompts = [tok.encode(PROMPTS[0]), tok.encode(PROMPTS[2])]
  state = eng.init_state()
  pre = eng.prefill(params, prompts, jnp.stack([jax.random.key(0)] * 2), [0.0] * 2, [0] * 2,
                    [1.0] * 2)
  state = eng.insert(pre, state, [0, 1], [60, 60], [0.0] * 2, [0] * 2, [1.0] * 2)
  state = eng.generate(params, state, 7)
  m = model_lib.bind(eng.graphdef, params)
  for r in range(2):
    n = int(state.rows.length[r])
    toks = state.rows.tokens[r: r + 1, :n]
    h, _ = m(toks, jnp.arange(n)[None])
    padded = jnp.pad(toks, ((0, 0), (0, 4)))
    for i, module in enumerate(m.heads.modules):
      # Module i+1 over trunk positions 0..n-1 at input positions i+1..n+i; the entries whose
      # input token is committed (positions <= n-1) must match the decode state's.
      fresh = kv.init_cache(mcfg, 1, state.caches.draft.max_len)
      h, _, (ck, cv) = module(h, m.trunk.embed(padded[:, i + 1: i + 1 + n]),
                              (jnp.arange(n) + i + 1)[None], (fresh.k[0], fresh.v[0]),
                              key_min=i + 1)
      for got, want in ((state.caches.draft.k[i], ck), (state.caches.draft.v[i], cv)):
        np.testing.assert_allclose(np.asarray(got[r, i + 1: n]), np.asarray(want[0, i + 1: n]),
                                   atol=2e-5, err_msg=f"row {r} module {i + 1}")


def test_sampling_is_lossless(seq_model):
  (mcfg, hcfg, params, tok), _ = seq_model
  prompt = tok.encode("for i in range(10):\n    for i in range(")

  def sample(k, seed):
    eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=64, k=k, ring_size=8), tok.eod_id)
    rows = []
    for r in range(16):
      state = eng.init_state(seed * 100 + r)
      pre = eng.prefill(params, [prompt] * 64, jax.random.key(seed * 100 + r), [1.0] * 64,
                        [8] * 64, [1.0] * 64)
      state = eng.insert(pre, state, list(range(64)), 3, 1.0, 8, 1.0)
      state = eng.generate(params, state, 8, sample=True)
      rows.append(np.asarray(state.rows.tokens)[:, len(prompt) + 1: len(prompt) + 3])
    return np.concatenate(rows), state_lib.stats(state)

  a, _ = sample(0, 1)
  b, st = sample(3, 2)
  pairs = lambda x: [f"{p},{q}" for p, q in x]
  assert_same_distribution(pairs(a), pairs(b), min_categories=4)
  assert sum(st["accepted"]) > 0


@pytest.mark.slow
def test_no_recompilation_after_warmup(seq_model):
  model = seq_model[0]
  tok = model[3]
  dec = _decoder(model, k=3)
  dec.warmup(max_prompt_len=40)
  with compiles() as compiled:
    dec.run([api.Request(tok.encode(p), n, t) for p, n, t in
             zip(PROMPTS, [20, 9, 14, 5, 11], [0.0, 1.0, 0.0, 0.7, 0.0])])
  assert compiled == [], compiled


def test_config_checks():
  m = config_lib.ModelConfig()
  with pytest.raises(config_lib.ConfigError, match="decode.reuse_module=True: needs sequential"):
    resolve(DecodeConfig(k=2, reuse_module=True), m, HeadsConfig(kind="parallel", num=3))
  with pytest.raises(config_lib.ConfigError, match="or set decode.reuse_module"):
    resolve(DecodeConfig(k=5), m, HeadsConfig(kind="sequential", num=3))
  assert resolve(DecodeConfig(k=5, reuse_module=True), m,
                 HeadsConfig(kind="sequential", num=1)).k == 5
  # One module and k > 1: reusing it is the only way, so it is implied.
  assert resolve(DecodeConfig(k=3), m, HeadsConfig(kind="sequential", num=1)).reuse_module
  assert not resolve(DecodeConfig(k=1), m, HeadsConfig(kind="sequential", num=1)).reuse_module
  with pytest.raises(config_lib.ConfigError, match="heads.layers=2: applies to parallel"):
    HeadsConfig(kind="sequential", layers=2)
  with pytest.raises(config_lib.ConfigError, match="heads.module_d_ff=64: applies to sequential"):
    HeadsConfig(kind="parallel", module_d_ff=64)


def test_narrow_module_mlp():
  """heads.module_d_ff sets the modules' MLP width (a lighter module), the trunk's unchanged."""
  mcfg = config_lib.ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                d_ff=64, max_seq_len=64)
  full = model_lib.split(model_lib.create(mcfg, HeadsConfig(kind="sequential", num=1)))[1]
  narrow = model_lib.split(model_lib.create(
      mcfg, HeadsConfig(kind="sequential", num=1, module_d_ff=16)))[1]
  mlp = narrow["heads"]["modules"][0]["block"]["mlp"]
  assert mlp["gate_DF"].shape == (32, 16) and mlp["down_FD"].shape == (16, 32)
  assert narrow["trunk"]["blocks"][0]["mlp"]["gate_DF"].shape == (32, 64)
  assert model_lib.count_params(full) - model_lib.count_params(narrow) == 3 * 32 * (64 - 16)
  assert dataclasses.replace(DecodeConfig(), k=0).k == 0
