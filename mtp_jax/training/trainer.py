"""The optimizer, the train step, held-out evaluation, and the resumable training loop (losses:
`losses.py`; the workdir's tokenizer, token cache and run config: `workdir.py`).

Modes:
  joint       trunk loss + head_loss_weight * mean(head losses), all parameters trained.
  heads_only  the trunk is frozen (not differentiated, no optimizer state) and heads learn by
              self-distillation: head i at t is taught the trunk's own prediction at t+i, along
              corpus text or along the trunk's greedy continuation of corpus prompts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from mtp_jax import config as config_lib
from mtp_jax import sharding as sharding_lib
from mtp_jax.config import Config
from mtp_jax.decoding import shapes
from mtp_jax.formats import checkpoint as ckpt_lib
from mtp_jax.formats.tokenizer import Tokenizer
from mtp_jax.models import model as model_lib
from mtp_jax.training import data as data_lib
from mtp_jax.training import generate as gen_lib
from mtp_jax.training import workdir as workdir_lib
from mtp_jax.training.losses import agreement, compute_losses
from mtp_jax.training.workdir import init_from_model_section  # noqa: F401 (mtp-train uses it)


class TrainingDiverged(RuntimeError):
  """The loss became NaN or inf; the last good checkpoint is kept."""


# ----------------------------------------------------------------------------- optimizer


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  tc = cfg.train
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.lr, warmup_steps=tc.warmup_steps,
      decay_steps=max(tc.steps, tc.warmup_steps + 1), end_value=tc.lr * tc.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(tc.grad_clip),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=tc.weight_decay, mask=decay_mask))


def split_trainable(params: dict, mode: str) -> tuple[dict, dict]:
  if mode == "heads_only":
    return {"heads": params["heads"]}, {"trunk": params["trunk"]}
  return params, {}


# ----------------------------------------------------------------------------- the trainer


@dataclasses.dataclass
class Trainer:
  """Holds the compiled functions of one run; `train()` builds one from a config and workdir."""
  cfg: Config
  graphdef: object
  tokenizer: Tokenizer
  tx: optax.GradientTransformation
  mesh: jax.sharding.Mesh | None = None
  state_shardings: tuple | None = None    # (trainable, opt_state) shardings, kept by the step

  def __post_init__(self):
    cfg, gd, eod = self.cfg, self.graphdef, self.tokenizer.eod_id
    mode, tgt = cfg.train.mode, cfg.train.distill_target

    def loss_fn(trainable, frozen, tokens_BW):
      m = model_lib.bind(gd, {**frozen, **trainable})
      trunk_loss, head_losses = compute_losses(m, tokens_BW, eod, mode, tgt,
                                               cfg.train.head_loss_stride)
      if mode == "heads_only":
        total = jnp.mean(head_losses)
      else:
        total = trunk_loss + cfg.train.head_loss_weight * jnp.mean(head_losses)
      return total, {"loss": total, "trunk_loss": trunk_loss, "head_losses": head_losses}

    def train_step(trainable, frozen, opt_state, tokens_BW):
      grads, metrics = jax.grad(loss_fn, has_aux=True)(trainable, frozen, tokens_BW)
      updates, opt_state = self.tx.update(grads, opt_state, trainable)
      trainable = optax.apply_updates(trainable, updates)
      metrics["grad_norm"] = optax.tree.norm(grads)
      return trainable, opt_state, metrics

    out = None if self.state_shardings is None else (*self.state_shardings, None)
    self.train_step = jax.jit(train_step, donate_argnames=("trainable", "opt_state"),
                              out_shardings=out)

    def eval_step(params, tokens_BW, start):
      m = model_lib.bind(gd, params)
      trunk_loss, head_losses = compute_losses(m, tokens_BW, eod, "joint")
      per_head, accept_len, (hits, trials) = agreement(m, tokens_BW, eod, start,
                                                      shapes.DEFAULT_TOP_K)
      return trunk_loss, head_losses, per_head, accept_len, hits, trials

    self.eval_step = jax.jit(eval_step, static_argnames=("start",))

  def distill_batch(self, params, tokens_BW, lengths_B=None):
    """Prompt + the trunk's own greedy continuation of W - P tokens, a window of W: the prompt is
    each row's first P = distill_prompt_len tokens, or with lengths_B (chat prompts, right-padded)
    its first lengths_B[b], and a row whose prompt is shorter ends in end-of-document tokens."""
    p = self.cfg.train.distill_prompt_len
    w = self.cfg.data.seq_len + self.cfg.heads.num + 1
    b = tokens_BW.shape[0]
    prompt = self.put(np.asarray(tokens_BW)[:, :p])
    lengths_B = jnp.asarray(np.full((b,), p) if lengths_B is None else lengths_B, jnp.int32)
    return gen_lib.greedy_generate(self.graphdef, params, prompt, lengths_B, w - p,
                                   pad_id=self.tokenizer.eod_id)

  def prepare(self, params, batch):
    """A training batch on the mesh. `batch`: windows [B, W], or (prompt_BP, lengths_B) from
    data.PromptBatches (heads_only on a JSONL corpus's prompts)."""
    if self.cfg.train.mode != "heads_only" or self.cfg.train.distill_source != "generated":
      return self.put(batch)
    tokens, lengths_B = batch if isinstance(batch, tuple) else (batch, None)
    return self.distill_batch(params, tokens, lengths_B)

  def put(self, batch):
    """A global host batch onto the mesh, rows on 'data'."""
    if self.mesh is None:
      return jnp.asarray(batch)
    return sharding_lib.put_batch(np.asarray(batch), self.mesh)

  def evaluate(self, params, batches) -> dict:
    """Held-out trunk loss / perplexity, and per-head agreement with the trunk along held-out
    text (teacher-forced) and along the trunk's own greedy continuation of held-out prompts, where
    also each rank of a head's top candidates is counted (the rates token trees are built from:
    self.tree_rates, and head{i}_top{R}, how often the trunk's token is among them)."""
    if not batches:
      return {}
    p = self.cfg.train.distill_prompt_len
    sums = {}
    for batch in batches:
      tl, hl, agree_tf, *_ = self.eval_step(params, self.put(batch), 0)
      gen = self.distill_batch(params, batch)
      _, _, agree_gen, accept_len, hits, trials = self.eval_step(params, gen, p - 1)
      for name, v in (("trunk_loss", tl), ("head_loss", hl), ("agree_tf", agree_tf),
                      ("agree_gen", agree_gen), ("accept_len_gen", accept_len),
                      ("hits", hits), ("trials", trials)):
        sums[name] = sums.get(name, 0.0) + np.asarray(v, np.float64)
    self.tree_rates = shapes.rates_from_hits(sums.pop("hits"), sums.pop("trials"))
    out = {k: v / len(batches) for k, v in sums.items()}
    res = {"trunk_loss": float(out["trunk_loss"]), "perplexity": float(math.exp(out["trunk_loss"])),
           "accept_len_gen": float(out["accept_len_gen"])}
    for i in range(self.cfg.heads.num):
      res[f"head{i + 1}_loss"] = float(out["head_loss"][i])
      res[f"head{i + 1}_agree_tf"] = float(out["agree_tf"][i])
      res[f"head{i + 1}_agree_gen"] = float(out["agree_gen"][i])
      res[f"head{i + 1}_top{shapes.DEFAULT_TOP_K}"] = float(sum(self.tree_rates[i]))
    return res


def _init_params(cfg: Config, mesh, rules):
  """Parameters created directly sharded: abstract shapes -> shardings -> jitted init with
  those out shardings (no full copy on one device first)."""
  graphdef, abstract = model_lib.abstract(cfg.model, cfg.heads)
  shardings = sharding_lib.tree_shardings(abstract, mesh, rules)
  params = jax.jit(lambda: model_lib.split(model_lib.create(cfg.model, cfg.heads,
                                                            cfg.train.seed))[1],
                   out_shardings=shardings)()
  if cfg.train.mode != "heads_only":
    return graphdef, params
  # Restored onto the mesh with the source's own layout (its heads may differ from this run's).
  src_m, src_h = ckpt_lib.read_model_config(cfg.train.init_from)
  src_shardings = sharding_lib.tree_shardings(model_lib.abstract(src_m, src_h)[1], mesh, rules)
  mcfg, hcfg, src, _ = ckpt_lib.load_model_dir(cfg.train.init_from, shardings=src_shardings)
  if mcfg != cfg.model:
    raise ValueError(f"train.init_from={cfg.train.init_from!r}: its model config {mcfg} differs "
                     f"from this run's {cfg.model}")
  params = {"trunk": src["trunk"],
            "heads": src["heads"] if hcfg == cfg.heads else params["heads"]}
  return graphdef, params


def train(cfg: Config, workdir: str, log: Callable[[str], None] = logging.info,
          stop_after: int | None = None,
          progress: Callable[[int, int, float], None] | None = None) -> dict:
  """Trains (or resumes) a run in `workdir`; returns the final evaluation. `progress(step,
  steps, loss)` is called as each step's loss is read (one step late: the host never waits on
  the step it just launched).

  Writes checkpoints under workdir/checkpoints, metrics to workdir/metrics.jsonl and, at the end,
  a model directory at workdir/model. `stop_after` ends the process early after that many steps
  of this call (used to test resumption) without exporting.
  """
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.check_run_config(workdir, cfg, write=False)
  data = _Data.load(cfg, workdir)
  workdir_lib.check_run_config(workdir, cfg)      # written once the corpus has loaded
  mesh = sharding_lib.make_mesh(cfg.mesh.shape)
  rules = sharding_lib.parse_rules(cfg.mesh.rules)
  if cfg.train.batch_size % mesh.shape["data"]:
    raise config_lib.ConfigError(f"train.batch_size={cfg.train.batch_size}: must divide over the "
                                 f"mesh's data={mesh.shape['data']} devices")
  graphdef, params = _init_params(cfg, mesh, rules)
  tx = make_optimizer(cfg)
  trainable, frozen = split_trainable(params, cfg.train.mode)
  opt_shardings = sharding_lib.tree_shardings(jax.eval_shape(tx.init, trainable), mesh, rules)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(trainable)
  trainer = Trainer(cfg, graphdef, data.tokenizer, tx, mesh,
                    (jax.tree.map(lambda x: x.sharding, trainable), opt_shardings))
  ckptr = ckpt_lib.TrainCheckpointer(os.path.join(workdir, "checkpoints"), cfg.train.keep_checkpoints)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  step = ckptr.latest_step()
  if step is not None:
    # Restored straight onto this run's mesh, whatever mesh wrote the checkpoint.
    abstract = lambda t: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
    full, opt_state, data_state = ckptr.restore(step, abstract({**frozen, **trainable}),
                                                abstract(opt_state))
    trainable, frozen = split_trainable(full, cfg.train.mode)
    data.batches.restore(data_state)
    workdir_lib.truncate_metrics(metrics_path, step)
    log(f"resumed from step {step} in {workdir}")
  _describe(cfg, mesh, rules, params, data, log)
  out = _Progress(cfg, workdir, metrics_path, log, progress, data.window, step)
  step = step or 0
  run_steps, final_eval = 0, {}
  pending = None                 # (step, metrics) of the last launched step, read one step late
  while step < cfg.train.steps:
    batch = trainer.prepare({**frozen, **trainable}, next(data.batches))
    trainable, opt_state, metrics = trainer.train_step(trainable, frozen, opt_state, batch)
    step += 1
    run_steps += 1
    if pending is not None:                  # the previous step's metrics: ready by now
      out.read(*pending)
    pending = (step, metrics)
    at_end = step == cfg.train.steps
    if step % cfg.train.checkpoint_every == 0 or at_end:
      out.check(*pending)                    # never checkpoint a diverged state
      ckptr.save(step, {**frozen, **trainable}, opt_state, data.batches.state())
      out.last_good = step
    if step % cfg.train.eval_every == 0 or at_end:
      final_eval = trainer.evaluate({**frozen, **trainable}, data.eval_batches)
      out.evaluation(step, final_eval)
    if stop_after is not None and run_steps >= stop_after:
      ckptr.close()
      out.close()
      return {}
  if pending is not None and pending[0] % cfg.train.log_every == 0:
    out.report(*pending)
  ckptr.close()
  out.close()
  _export(cfg, workdir, {**frozen, **trainable}, data.tokenizer, trainer, log)
  return final_eval


@dataclasses.dataclass
class _Data:
  """A run's tokenizer, token streams and batches (window: tokens a training row holds)."""
  tokenizer: Tokenizer
  n_train: int
  n_heldout: int
  window: int
  batches: data_lib.BatchIterator       # or PromptBatches (heads_only on JSONL prompts)
  eval_batches: list

  @classmethod
  def load(cls, cfg: Config, workdir: str) -> "_Data":
    window = cfg.data.seq_len + cfg.heads.num + 1
    tokenizer, train_tokens, heldout_tokens, prompts = workdir_lib.load_corpus(cfg, workdir,
                                                                               window)
    if prompts is None:
      batches = data_lib.BatchIterator(train_tokens, cfg.train.batch_size, window, cfg.data.seed)
    else:
      batches = data_lib.PromptBatches(prompts, cfg.train.batch_size, cfg.data.seed)
    return cls(tokenizer, len(train_tokens), len(heldout_tokens), window, batches,
               data_lib.heldout_batches(heldout_tokens, cfg.train.batch_size, window,
                                        cfg.train.eval_batches))


def _describe(cfg: Config, mesh, rules, params, data: _Data, log):
  """Logs the model's size, the mesh's layout and the data's."""
  n_params = model_lib.count_params(params)
  if mesh.size > 1:
    log(f"mesh {dict(mesh.shape)}: params {sharding_lib.bytes_per_device(params) / 2**20:.1f} MiB "
        f"per device")
    for line in sharding_lib.describe(mesh, params, rules)[:8]:
      log("  " + line)
  log(f"model: {n_params / 1e6:.2f}M parameters ({model_lib.count_params(params['heads']) / 1e6:.2f}M "
      f"in {cfg.heads.num} {cfg.heads.kind} heads); mode={cfg.train.mode}; "
      f"{data.n_train:,} train / {data.n_heldout:,} held-out tokens")
  if isinstance(data.batches, data_lib.PromptBatches):
    log(f"self-distillation from {data.batches.num_windows:,} prompts of at most "
        f"{cfg.train.distill_prompt_len} tokens ({cfg.data.path})")


class _Progress:
  """The run's metrics as they are read: checked for divergence, logged every log_every steps
  and appended to metrics.jsonl (one writer when several hosts run the same loop)."""

  def __init__(self, cfg: Config, workdir, metrics_path, log, progress, window, latest):
    self.cfg, self.workdir, self.log, self.progress = cfg, workdir, log, progress
    self.file = open(metrics_path, "a")
    self.tokens_per_step = cfg.train.batch_size * (window - 1)
    self.t_last, self.step_last = time.perf_counter(), latest or 0
    self.last_good = latest            # the last checkpoint written (or restored)

  def write(self, rec: dict):
    if jax.process_index() == 0:
      self.file.write(json.dumps(rec) + "\n")
      self.file.flush()

  def read(self, step: int, m: dict):
    """A step's metrics, one step late: reported every log_every steps, else checked."""
    if step % self.cfg.train.log_every == 0:
      self.report(step, m)
    else:
      self.check(step, m)

  def check(self, step: int, m: dict) -> float:
    loss = float(m["loss"])
    if not math.isfinite(loss):
      raise TrainingDiverged(f"loss is {loss} at step {step}; stopped. The last good checkpoint "
                             f"is step {self.last_good} in {self.workdir}/checkpoints")
    if self.progress is not None:
      self.progress(step, self.cfg.train.steps, loss)
    return loss

  def report(self, step: int, m: dict):
    loss = self.check(step, m)
    now = time.perf_counter()
    rate = (step - self.step_last) * self.tokens_per_step / max(now - self.t_last, 1e-9)
    eta = (self.cfg.train.steps - step) * self.tokens_per_step / max(rate, 1e-9)
    heads = [float(x) for x in np.asarray(m["head_losses"])]
    rec = {"kind": "train", "step": step, "loss": loss, "trunk_loss": float(m["trunk_loss"]),
           **{f"head{i + 1}_loss": v for i, v in enumerate(heads)},
           "grad_norm": float(m["grad_norm"]), "tokens_per_s": rate}
    self.write(rec)
    self.log(f"step {step}/{self.cfg.train.steps} loss {loss:.4f} trunk {rec['trunk_loss']:.4f} "
             "heads " + " ".join(f"{v:.3f}" for v in heads)
             + f" | {rate:,.0f} tok/s | ETA {eta / 60:.1f} min")
    self.t_last, self.step_last = now, step

  def evaluation(self, step: int, res: dict):
    if res:
      self.write({"kind": "eval", "step": step, **res})
      self.log(f"eval step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in res.items()))

  def close(self):
    self.file.close()


def _export(cfg: Config, workdir: str, params, tokenizer, trainer, log):
  """The model directory at workdir/model, with the heads' token trees where measured."""
  hf_config = (ckpt_lib.read_meta(cfg.train.init_from).get("hf_config")
               if cfg.train.init_from else None)
  ckpt_lib.save_model_dir(os.path.join(workdir, "model"), cfg, params, tokenizer,
                          cfg.train.save_dtype, hf_config=hf_config)
  rates = getattr(trainer, "tree_rates", None)
  if rates is not None:     # the last evaluation's top-i acceptance: the model's token trees
    shapes.save_trees(os.path.join(workdir, "model", shapes.TREES_FILE), rates,
                      {b: shapes.build_tree(rates, b) for b in shapes.DEFAULT_BUDGETS})
  log(f"model directory written to {os.path.join(workdir, 'model')}")
