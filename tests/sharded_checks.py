"""Checks on 8 simulated CPU devices, run in a fresh process (the device count must be set before
JAX starts): `python -m tests.sharded_checks CASE WORKDIR`. Exits non-zero with the reason."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import tiny  # noqa: E402
from mtp_jax import config as config_lib  # noqa: E402
from mtp_jax import sharding as S  # noqa: E402
from mtp_jax.config import DecodeConfig  # noqa: E402
from mtp_jax.formats import checkpoint as ckpt_lib  # noqa: E402
from mtp_jax.models import model as model_lib  # noqa: E402
from mtp_jax.serving import api  # noqa: E402
from mtp_jax.training import trainer as train_lib  # noqa: E402

# model:8 does not divide the tiny config's 4 heads (they would be replicated): model:4 instead.
MESHES = ["data:8", "model:4", "data:2,model:4"]
PROMPTS = ["def f(x):\n    return x\n\ndef f(", "import os\nimport sys\nimport ", "class A:\n",
           "for i in range(10):\n    for i in range(", "x = 1\n", "try:\n    ", "if x:\n", "# a"]


def _cfg(**train):
  d = tiny.get_config().to_dict()
  d["train"].update(train)
  return config_lib.Config.from_dict(d)


def train_steps(workdir):
  """Three train steps of the tiny model on one device and on each mesh: same losses, same
  parameters (fp32 tolerance)."""
  cfg = _cfg(batch_size=8)
  rng = np.random.RandomState(0)
  batches = [rng.randint(0, cfg.model.vocab_size, (8, cfg.data.seq_len + cfg.heads.num + 1))
             for _ in range(3)]
  del workdir
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  tok = ckpt_lib.load_tokenizer(os.path.join(root, "pretrained", "demo"))  # its EOD is all we need

  def run(spec):
    mesh = S.make_mesh(spec)
    rules = S.parse_rules(cfg.mesh.rules)
    graphdef, params = train_lib._init_params(cfg, mesh, rules)
    tx = train_lib.make_optimizer(cfg)
    opt_sh = S.tree_shardings(jax.eval_shape(tx.init, params), mesh, rules)
    opt = jax.jit(tx.init, out_shardings=opt_sh)(params)
    tr = train_lib.Trainer(cfg, graphdef, tok, tx, mesh,
                           (jax.tree.map(lambda x: x.sharding, params), opt_sh))
    losses = []
    for b in batches:
      params, opt, m = tr.train_step(params, {}, opt, tr.put(b))
      losses.append(float(m["loss"]))
    return losses, jax.tree.map(np.asarray, params), params

  ref_losses, ref_params, _ = run("data:1")
  for spec in MESHES:
    losses, params, live = run(spec)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, err_msg=spec)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6,
                                                         err_msg=spec), params, ref_params)
    wq = live["trunk"]["blocks"][0]["attn"]["wq_DNH"]
    assert len(wq.sharding.device_set) == S.make_mesh(spec).size, (spec, wq.sharding)
    if "model" in spec:
      assert tuple(wq.sharding.spec) == (None, "model", None), wq.sharding
    print(f"{spec}: losses {losses} == {ref_losses}; wq sharding {wq.sharding.spec}")


def decode_and_restore(workdir):
  """A short tiny run trained on data:2 x model:4 resumes on 8 x 1 and writes its model directory;
  that restores onto 8 x 1, 2 x 4, 1 x 8 and one device, and greedy speculative decoding gives
  the same tokens everywhere."""
  out = os.path.join(workdir, "mesh_run")
  cfg = config_lib.Config.from_dict({**_cfg(steps=4, checkpoint_every=2, eval_every=4,
                                            log_every=2).to_dict(),
                                     "mesh": {"shape": "data:2,model:4"}})
  train_lib.train(cfg, out, log=lambda s: None)
  # The training checkpoint (step 4, written on 2 x 4) resumes on 8 x 1 for two more steps.
  resumed = []
  more = config_lib.Config.from_dict({**_cfg(steps=6, checkpoint_every=2, eval_every=6,
                                             log_every=2).to_dict(), "mesh": {"shape": "data:8"}})
  train_lib.train(more, out, log=resumed.append)
  assert any("resumed from step 4" in line for line in resumed), resumed
  model_dir = os.path.join(out, "model")
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(model_dir)
  reqs = [api.Request(tok.encode(p), n) for p, n in zip(PROMPTS, [30, 7, 25, 40, 18, 12, 33, 20])]
  dcfg = DecodeConfig(batch_size=8, ring_size=8, k=3)
  plain = api.Decoder(mcfg, hcfg, params, tok, dataclasses.replace(dcfg, k=0)).run(reqs)
  one = api.Decoder(mcfg, hcfg, params, tok, dcfg).run(reqs)
  assert [c.token_ids for c in one] == [c.token_ids for c in plain]
  for spec in ("data:8", "data:2,model:4", "model:8"):
    mesh = S.make_mesh(spec)
    rules = S.parse_rules(config_lib.DEFAULT_RULES)
    _, abstract = model_lib.abstract(mcfg, hcfg)
    _, _, sharded, _ = ckpt_lib.load_model_dir(model_dir,
                                              shardings=S.tree_shardings(abstract, mesh, rules))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    dec = api.Decoder(mcfg, hcfg, sharded, tok, dcfg, mesh=mesh)
    got = dec.run(reqs)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain], spec
    cache_k = dec.engine.state_sharding.caches.trunk.k[0]
    print(f"{spec}: {sum(len(c.token_ids) for c in got)} tokens identical; cache sharding "
          f"{cache_k.spec}; acceptance {dec.last_stats['acceptance_length']:.2f}")


if __name__ == "__main__":
  case, workdir = sys.argv[1], sys.argv[2]
  assert len(jax.devices()) == 8, jax.devices()
  {"train_steps": train_steps, "decode_and_restore": decode_and_restore}[case](workdir)
  print("OK")
