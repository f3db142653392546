"""Losses, the train step, held-out evaluation, and the resumable training loop.

Batches are windows of W = seq_len + K + 1 tokens. The trunk runs on the first W - 1 and predicts
token t+1 at every position t; head i (1..K) at position t predicts token t+1+i, masked where that
lies past the window or past an end-of-document token.

Modes:
  joint       trunk loss + head_loss_weight * mean(head losses), all parameters trained.
  heads_only  the trunk is frozen (not differentiated, no optimizer state) and heads learn by
              self-distillation: head i at t is taught the trunk's own prediction at t+i, along
              corpus text or along the trunk's greedy continuation of corpus prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
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

from mtp_jax import checkpoint as ckpt_lib
from mtp_jax import data as data_lib
from mtp_jax import generate as gen_lib
from mtp_jax import model as model_lib
from mtp_jax import config as config_lib
from mtp_jax import sharding as sharding_lib
from mtp_jax.config import Config
from mtp_jax.tokenizer import Tokenizer, train_bpe


class TrainingDiverged(RuntimeError):
  """The loss became NaN or inf; the last good checkpoint is kept."""


# ----------------------------------------------------------------------------- losses


def head_targets(tokens_BW, num_heads: int, eod_id: int):
  """Targets and masks for the K heads at each of the W - 1 input positions.

  -> targets [B, W-1, K] (token t+1+i for head i), mask [B, W-1, K] (1 where the target exists
  inside the window and no end-of-document token lies in tokens t+1 .. t+i).
  """
  b, w = tokens_BW.shape
  t = w - 1
  targets, masks = [], []
  is_eod = tokens_BW == eod_id
  for i in range(1, num_heads + 1):
    idx = jnp.arange(t) + 1 + i                                   # target position
    valid = idx <= w - 1
    tgt = jnp.take(tokens_BW, jnp.minimum(idx, w - 1), axis=1)
    # EOD among tokens t+1 .. t+i means the target belongs to another document.
    crossed = jnp.zeros((b, t), bool)
    for j in range(1, i + 1):
      crossed |= jnp.take(is_eod, jnp.minimum(jnp.arange(t) + j, w - 1), axis=1)
    targets.append(tgt)
    masks.append(valid[None, :] & ~crossed)
  return jnp.stack(targets, -1), jnp.stack(masks, -1).astype(jnp.float32)


def shift_along(x_BTx, i: int):
  """x at position t + i for every t (the tail is padded with the last entry; mask it)."""
  t = x_BTx.shape[1]
  idx = jnp.minimum(jnp.arange(t) + i, t - 1)
  return jnp.take(x_BTx, idx, axis=1)


def _masked_mean(x, mask):
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _xent(logits, target_ids=None, target_probs=None):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  if target_probs is not None:
    return -jnp.sum(target_probs * logp, axis=-1)
  return -jnp.take_along_axis(logp, target_ids[..., None], axis=-1)[..., 0]


def compute_losses(m: model_lib.MTPModel, tokens_BW, eod_id: int, mode: str,
                   distill_target: str = "hard", head_stride: int = 1):
  """-> (total loss, metrics). Head logits are formed one head at a time under remat, so peak
  memory holds one [B, T, V] block, not K of them (Gloeckle et al.). With head_stride > 1 the
  heads are trained on every head_stride-th position only: with K heads the unembedding runs K+1
  times per position and dominates a small model's FLOPs."""
  x_BT = tokens_BW[:, :-1]
  b, t = x_BT.shape
  k = m.heads_cfg.num
  pos_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
  h_BTD, _ = m(x_BT, pos_BT)
  if mode == "heads_only":
    h_BTD = jax.lax.stop_gradient(h_BTD)
  trunk_logits = m.logits(h_BTD)
  trunk_loss = jnp.mean(_xent(trunk_logits, tokens_BW[:, 1:]))
  head_tgt, head_mask = head_targets(tokens_BW, k, eod_id)
  if m.heads_cfg.kind == "sequential":   # modules attend along the sequence: run it whole
    hh_BTKD = m.head_hidden(h_BTD, tokens_BW)[:, ::head_stride]
  else:
    hh_BTKD = m.head_hidden(h_BTD[:, ::head_stride])
  head_tgt, head_mask = head_tgt[:, ::head_stride], head_mask[:, ::head_stride]

  teacher = None
  if mode == "heads_only":
    teacher_logits = jax.lax.stop_gradient(trunk_logits)
    if distill_target == "hard":
      teacher = ("ids", jnp.argmax(teacher_logits, -1))
    else:
      teacher = ("probs", jax.nn.softmax(teacher_logits, -1))
    teacher = (teacher[0], [shift_along(teacher[1], i)[:, ::head_stride] for i in range(1, k + 1)])

  @jax.checkpoint
  def head_loss(hh_BTD, ids, probs, mask):
    logits = m.logits(hh_BTD)
    return _masked_mean(_xent(logits, ids, probs), mask)

  head_losses = []
  for i in range(1, k + 1):
    mask = head_mask[..., i - 1]
    if teacher is None:
      loss_i = head_loss(hh_BTKD[:, :, i - 1], head_tgt[..., i - 1], None, mask)
    elif teacher[0] == "ids":
      loss_i = head_loss(hh_BTKD[:, :, i - 1], teacher[1][i - 1], None, mask)
    else:
      loss_i = head_loss(hh_BTKD[:, :, i - 1], None, teacher[1][i - 1], mask)
    head_losses.append(loss_i)
  head_losses = jnp.stack(head_losses)
  return trunk_loss, head_losses


def agreement(m: model_lib.MTPModel, tokens_BW, eod_id: int, start: int = 0):
  """Per head, top-1 agreement with the trunk's own greedy prediction of the same token
  (teacher-forced acceptance proxy), over positions >= start; and the greedy acceptance length
  a step at each position would get with k = K (1 + the run of agreeing heads from head 1)."""
  x_BT = tokens_BW[:, :-1]
  b, t = x_BT.shape
  k = m.heads_cfg.num
  h_BTD, _ = m(x_BT, jnp.broadcast_to(jnp.arange(t), (b, t)))
  trunk_pred = jnp.argmax(m.logits(h_BTD), -1)
  head_pred = jnp.argmax(m.head_logits(h_BTD, tokens_BW), -1)     # [B, T, K]
  _, mask = head_targets(tokens_BW, k, eod_id)
  mask = mask * (jnp.arange(t) >= start)[None, :, None]
  agree = jnp.stack([head_pred[..., i - 1] == shift_along(trunk_pred, i)
                     for i in range(1, k + 1)], -1).astype(jnp.float32)
  per_head = jnp.sum(agree * mask, (0, 1)) / jnp.maximum(jnp.sum(mask, (0, 1)), 1.0)
  # Acceptance length only where every head has a target.
  full = mask[..., k - 1]
  run = jnp.sum(jnp.cumprod(agree, axis=-1), -1)
  accept_len = 1.0 + jnp.sum(run * full) / jnp.maximum(jnp.sum(full), 1.0)
  return per_head, accept_len


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
      per_head, accept_len = agreement(m, tokens_BW, eod, start)
      return trunk_loss, head_losses, per_head, accept_len

    self.eval_step = jax.jit(eval_step, static_argnames=("start",))

  def distill_batch(self, params, tokens_BW):
    """Corpus prompt + the trunk's own greedy continuation, the same window length."""
    p = self.cfg.train.distill_prompt_len
    b, w = tokens_BW.shape
    prompt = self.put(np.asarray(tokens_BW)[:, :p])
    return gen_lib.greedy_generate(self.graphdef, params, prompt,
                                   jnp.full((b,), p, jnp.int32), w - p)

  def prepare(self, params, tokens_BW):
    if self.cfg.train.mode == "heads_only" and self.cfg.train.distill_source == "generated":
      return self.distill_batch(params, tokens_BW)
    return self.put(tokens_BW)

  def put(self, batch):
    """A global host batch onto the mesh, rows on 'data'."""
    if self.mesh is None:
      return jnp.asarray(batch)
    return sharding_lib.put_batch(np.asarray(batch), self.mesh)

  def evaluate(self, params, batches) -> dict:
    """Held-out trunk loss / perplexity, and per-head agreement with the trunk along held-out
    text (teacher-forced) and along the trunk's own greedy continuation of held-out prompts."""
    if not batches:
      return {}
    p = self.cfg.train.distill_prompt_len
    sums = {}
    for batch in batches:
      tl, hl, agree_tf, _ = self.eval_step(params, self.put(batch), 0)
      gen = self.distill_batch(params, batch)
      _, _, agree_gen, accept_len = self.eval_step(params, gen, p - 1)
      for name, v in (("trunk_loss", tl), ("head_loss", hl), ("agree_tf", agree_tf),
                      ("agree_gen", agree_gen), ("accept_len_gen", accept_len)):
        sums[name] = sums.get(name, 0.0) + np.asarray(v, np.float64)
    out = {k: v / len(batches) for k, v in sums.items()}
    res = {"trunk_loss": float(out["trunk_loss"]), "perplexity": float(math.exp(out["trunk_loss"])),
           "accept_len_gen": float(out["accept_len_gen"])}
    for i in range(self.cfg.heads.num):
      res[f"head{i + 1}_loss"] = float(out["head_loss"][i])
      res[f"head{i + 1}_agree_tf"] = float(out["agree_tf"][i])
      res[f"head{i + 1}_agree_gen"] = float(out["agree_gen"][i])
    return res


def _token_cache(workdir: str, name: str, cfg: Config, files: list[str], tokenizer: Tokenizer):
  """Tokenized corpus split, cached in the workdir (numpy .npy, no pickle)."""
  fingerprint = json.dumps({"files": files, "root": data_lib.corpus_root(cfg.data),
                            "tokenizer": tokenizer.hf.to_str()}, sort_keys=True)
  key = str(abs(hash_str(fingerprint)))
  path = os.path.join(workdir, f"tokens_{name}_{key}.npy")
  if os.path.exists(path):
    return np.load(path, allow_pickle=False)
  tokens = data_lib.tokenize_files(cfg.data, files, tokenizer)
  tmp = path + ".tmp.npy"
  np.save(tmp, tokens, allow_pickle=False)
  os.replace(tmp, path)
  return tokens


def hash_str(s: str) -> int:
  return int.from_bytes(hashlib.sha1(s.encode()).digest()[:8], "little")


def _load_or_train_tokenizer(cfg: Config, workdir: str, train_files: list[str]) -> Tokenizer:
  path = os.path.join(workdir, "tokenizer.json")
  if cfg.train.init_from or cfg.data.tokenizer:
    src = cfg.data.tokenizer or cfg.train.init_from
    tok = ckpt_lib.load_tokenizer(src)
  elif os.path.exists(path):
    tok = Tokenizer.load(path)
  else:
    texts = data_lib.iter_texts(cfg.data, train_files, cfg.data.tokenizer_train_bytes)
    tok = train_bpe(texts, cfg.model.vocab_size)
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                     f"{tok.vocab_size} tokens")
  tok.save(path)
  return tok


def init_from_model_section(model_dir: str) -> dict:
  """The model section of a model directory's config.json, for a run that starts from it."""
  path = os.path.join(model_dir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"train.init_from={model_dir!r}: no config.json there (not a model directory)")
  with open(path) as f:
    text = f.read()
  mcfg, _ = config_lib.load_model_dir_config(text, path)
  return dataclasses.asdict(mcfg)


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


def _check_run_config(workdir: str, cfg: Config):
  """A workdir belongs to one model: resuming with a different model or data config is refused
  (train fields such as steps may change)."""
  path = os.path.join(workdir, "run_config.json")
  # A run may resume on another mesh: the mesh is not part of what a workdir is bound to.
  fixed = {k: v for k, v in cfg.to_dict().items() if k not in ("train", "mesh")}
  fixed["train.mode"] = cfg.train.mode
  fixed["train.seed"] = cfg.train.seed
  fixed["train.batch_size"] = cfg.train.batch_size
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old != json.loads(json.dumps(fixed)):
      diff = sorted(k for k in set(old) | set(fixed) if old.get(k) != json.loads(json.dumps(fixed)).get(k))
      raise ValueError(f"--workdir={workdir} holds a run with a different configuration "
                       f"(differs in: {diff}); use a new workdir")
  else:
    with open(path, "w") as f:
      json.dump(fixed, f, indent=2)


def _truncate_metrics(path: str, last_step: int):
  """Drops metric lines written after the checkpoint a resumed run starts from."""
  if not os.path.exists(path):
    return
  keep = []
  with open(path) as f:
    for line in f:
      try:
        rec = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut by a kill
      if rec.get("step", 0) <= last_step:
        keep.append(line if line.endswith("\n") else line + "\n")
  with open(path, "w") as f:
    f.writelines(keep)


def train(cfg: Config, workdir: str, log: Callable[[str], None] = logging.info,
          stop_after: int | None = None) -> dict:
  """Trains (or resumes) a run in `workdir`; returns the final evaluation.

  Writes checkpoints under workdir/checkpoints, metrics to workdir/metrics.jsonl and, at the end,
  a model directory at workdir/model. `stop_after` ends the process early after that many steps
  of this call (used to test resumption) without exporting.
  """
  os.makedirs(workdir, exist_ok=True)
  _check_run_config(workdir, cfg)
  train_files, heldout_files = data_lib.split_files(cfg.data)
  tokenizer = _load_or_train_tokenizer(cfg, workdir, train_files)
  train_tokens = _token_cache(workdir, "train", cfg, train_files, tokenizer)
  heldout_tokens = (_token_cache(workdir, "heldout", cfg, heldout_files, tokenizer)
                    if heldout_files else np.zeros((0,), np.int32))
  window = cfg.data.seq_len + cfg.heads.num + 1
  batches = data_lib.BatchIterator(train_tokens, cfg.train.batch_size, window, cfg.data.seed)
  eval_batches = data_lib.heldout_batches(heldout_tokens, cfg.train.batch_size, window,
                                          cfg.train.eval_batches)

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
  trainer = Trainer(cfg, graphdef, tokenizer, tx, mesh,
                    (jax.tree.map(lambda x: x.sharding, trainable), opt_shardings))
  ckptr = ckpt_lib.TrainCheckpointer(os.path.join(workdir, "checkpoints"), cfg.train.keep_checkpoints)
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  step = 0
  latest = ckptr.latest_step()
  if latest is not None:
    # Restored straight onto this run's mesh, whatever mesh wrote the checkpoint.
    abstract = lambda t: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
    full, opt_state, data_state = ckptr.restore(latest, abstract({**frozen, **trainable}),
                                                abstract(opt_state))
    trainable, frozen = split_trainable(full, cfg.train.mode)
    batches.restore(data_state)
    step = latest
    _truncate_metrics(metrics_path, latest)
    log(f"resumed from step {latest} in {workdir}")
  n_params = model_lib.count_params(params)
  if mesh.size > 1:
    log(f"mesh {dict(mesh.shape)}: params {sharding_lib.bytes_per_device(params) / 2**20:.1f} MiB "
        f"per device")
    for line in sharding_lib.describe(mesh, params, rules)[:8]:
      log("  " + line)
  log(f"model: {n_params / 1e6:.2f}M parameters ({model_lib.count_params(params['heads']) / 1e6:.2f}M "
      f"in {cfg.heads.num} {cfg.heads.kind} heads); mode={cfg.train.mode}; "
      f"{len(train_tokens):,} train / {len(heldout_tokens):,} held-out tokens")

  metrics_file = open(metrics_path, "a")
  def write_metrics(rec):
    if jax.process_index() == 0:           # one writer when several hosts run the same loop
      metrics_file.write(json.dumps(rec) + "\n")
      metrics_file.flush()

  tokens_per_step = cfg.train.batch_size * (window - 1)
  pending = None                 # (step, metrics) of the last launched step, read one step late
  t_last, step_last = time.perf_counter(), step
  last_good = latest
  final_eval = {}
  run_steps = 0

  def check(step_m, m):
    loss = float(m["loss"])
    if not math.isfinite(loss):
      raise TrainingDiverged(f"loss is {loss} at step {step_m}; stopped. The last good checkpoint "
                             f"is step {last_good} in {workdir}/checkpoints")
    return loss

  def report(step_m, m):
    nonlocal t_last, step_last
    loss = check(step_m, m)
    now = time.perf_counter()
    rate = (step_m - step_last) * tokens_per_step / max(now - t_last, 1e-9)
    eta = (cfg.train.steps - step_m) * tokens_per_step / max(rate, 1e-9)
    heads = [float(x) for x in np.asarray(m["head_losses"])]
    rec = {"kind": "train", "step": step_m, "loss": loss, "trunk_loss": float(m["trunk_loss"]),
           **{f"head{i + 1}_loss": v for i, v in enumerate(heads)},
           "grad_norm": float(m["grad_norm"]), "tokens_per_s": rate}
    write_metrics(rec)
    log(f"step {step_m}/{cfg.train.steps} loss {loss:.4f} trunk {rec['trunk_loss']:.4f} heads "
        + " ".join(f"{v:.3f}" for v in heads) + f" | {rate:,.0f} tok/s | ETA {eta / 60:.1f} min")
    t_last, step_last = now, step_m

  while step < cfg.train.steps:
    batch = trainer.prepare({**frozen, **trainable}, next(batches))
    trainable, opt_state, metrics = trainer.train_step(trainable, frozen, opt_state, batch)
    step += 1
    run_steps += 1
    if pending is not None:                  # the previous step's metrics: ready by now
      if pending[0] % cfg.train.log_every == 0:
        report(*pending)
      else:
        check(*pending)
    pending = (step, metrics)
    at_end = step == cfg.train.steps
    if step % cfg.train.checkpoint_every == 0 or at_end:
      check(*pending)                        # never checkpoint a diverged state
      ckptr.save(step, {**frozen, **trainable}, opt_state, batches.state())
      last_good = step
    if step % cfg.train.eval_every == 0 or at_end:
      final_eval = trainer.evaluate({**frozen, **trainable}, eval_batches)
      if final_eval:
        write_metrics({"kind": "eval", "step": step, **final_eval})
        log(f"eval step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in final_eval.items()))
    if stop_after is not None and run_steps >= stop_after:
      ckptr.close()
      metrics_file.close()
      return {}
  if pending is not None and pending[0] % cfg.train.log_every == 0:
    report(*pending)
  ckptr.close()
  metrics_file.close()
  params = {**frozen, **trainable}
  hf_config = (ckpt_lib.read_meta(cfg.train.init_from).get("hf_config")
               if cfg.train.init_from else None)
  ckpt_lib.save_model_dir(os.path.join(workdir, "model"), cfg, params, tokenizer,
                          cfg.train.save_dtype, hf_config=hf_config)
  log(f"model directory written to {os.path.join(workdir, 'model')}")
  return final_eval
