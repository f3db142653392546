"""The draft shapes adaptive k chooses among: chains of 0..Kd drafts, then token trees.

Shape index i <= Kd is the chain of i drafts (0: plain decoding); index Kd+1+j is trees[j]. The
controller weighs each by E[tokens emitted] / c(shape) (adaptive.py), c from the cost table (one
entry per shape). A chain's expectation comes from alpha_d, the conditional acceptance of head
d's best draft (the ring's counts); a tree's from the same alpha_d for its rank-0 nodes and, for a
node of rank r > 0, the share of the miss 1 - alpha_d that the model's measured rates give rank r
(Medusa's product model, shapes.py):

  p(d, 0) = alpha_d,   p(d, r) = (1 - alpha_d) * rates[d][r] / (1 - rates[d][0]),
  E[tree] = 1 + sum over its nodes of the product of p(depth, rank) along the node's path.

A tree's steps record what its rank-0 chain accepted (step.py), so the ring's counts stay those of
chains whatever shape ran. A tree is compiled only where, at the model's measured rates, it would
beat every chain the cost table leaves (viable): where a step of T+1 tokens costs much more than
one of k+1 (XLA:CPU at any batch, an accelerator at large batch) no tree is, and the engine drafts
as it would without trees.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np

from mtp_jax.config import ConfigError, DecodeConfig, HeadsConfig, ModelConfig, fail
from mtp_jax.decoding import shapes
from mtp_jax.decoding.shapes import Chain, Tree

ADAPTIVE_BUDGETS = (4, 8, 16)   # the node budgets of the trees `--k=auto` may choose


def row_expected(alpha_BK):
  """-> [..., K+1]: E[emitted tokens | a chain of k drafts], k = 0..K (leading axes: any)."""
  run = jnp.cumprod(alpha_BK, axis=-1)                                     # P(first j accepted)
  return 1.0 + jnp.concatenate([jnp.zeros_like(run[..., :1]), jnp.cumsum(run, axis=-1)], axis=-1)


@dataclasses.dataclass(frozen=True)
class ShapeSet:
  """Chains 0..kd and `trees`; rates[d][r]: the measured P(rank r of head d+1 is right)."""
  kd: int
  trees: tuple[Tree, ...] = ()
  rates: tuple[tuple[float, ...], ...] = ()

  @property
  def size(self) -> int:
    return self.kd + 1 + len(self.trees)

  @property
  def top_r(self) -> int:
    """Candidates per head the trees read (0: no trees)."""
    return max((t.top_k for t in self.trees), default=0)

  def shape(self, i: int) -> Chain | Tree:
    return Chain(i) if i <= self.kd else self.trees[i - self.kd - 1]

  def share_KR(self) -> np.ndarray:
    """[Kd, R] rank r's share of head d's miss mass (rank 0: 0)."""
    out = np.zeros((self.kd, max(self.top_r, 1)), np.float32)
    for d, row in enumerate(self.rates[:self.kd]):
      miss = 1.0 - row[0]
      rest = np.asarray(row[1:out.shape[1]], np.float32)
      if miss > 0 and len(rest):
        out[d, 1:1 + len(rest)] = rest / max(miss, rest.sum())
    return out

  def expected(self, alpha_BK, cut_BK=None):
    """-> [..., size]: E[emitted tokens] of every shape at the per-depth rates alpha [..., Kd]
    (cut_BK: where a draft may be verified at all; default everywhere)."""
    if cut_BK is not None:
      alpha_BK = jnp.where(cut_BK, alpha_BK, 0.0)
    chain = row_expected(alpha_BK)
    if not self.trees:
      return chain
    r = self.top_r
    a = alpha_BK[..., None]
    p = jnp.where(jnp.arange(r) == 0, a, (1.0 - a) * self.share_KR()[:, :r])   # [..., Kd, R]
    if cut_BK is not None:                 # past the cut no rank is verified
      p = jnp.where(cut_BK[..., None], p, 0.0)
    outs = [chain]
    for tree in self.trees:
      ranks_TD = _ranks_TD(tree)
      g = p[..., np.arange(tree.max_depth)[None], np.maximum(ranks_TD, 0)]      # [..., T, D]
      g = jnp.where(ranks_TD >= 0, g, 1.0)
      outs.append(1.0 + jnp.sum(jnp.prod(g, -1), -1)[..., None])
    return jnp.concatenate(outs, -1)

  def viable(self, cost, chains: tuple[int, ...], margin: float) -> tuple[int, ...]:
    """chains (adaptive.viable_ks) and the trees that, at the model's measured rates, would
    beat each of them and plain decoding by `margin`; a tree without a finite cost is never
    chosen. Host side."""
    if not self.trees:
      return chains
    cost = np.asarray(cost, np.float64)
    top1 = np.asarray([row[0] for row in self.rates[:self.kd]], np.float32)
    e = np.asarray(self.expected(jnp.asarray(top1)), np.float64)
    if len(cost) < self.size:
      cost = np.concatenate([cost, np.full(self.size - len(cost), np.inf)])
    best = max(e[k] / cost[k] for k in chains)
    plain = (1.0 + margin) * e[0] / cost[0]
    return chains + tuple(i for i in range(self.kd + 1, self.size)
                          if np.isfinite(cost[i]) and e[i] / cost[i] > max(best, plain))


def _ranks_TD(tree: Tree) -> np.ndarray:
  """[T, D] per node, the rank at each depth of its path (-1 past its depth)."""
  out = np.full((tree.size, tree.max_depth), -1, np.int32)
  for i, path in enumerate(tree.choices):
    out[i, :len(path)] = path
  return out


def chain_depth(tree: Tree) -> int:
  """How deep the tree's rank-0 chain (0,), (0, 0), ... goes."""
  d = 0
  while (0,) * (d + 1) in tree.choices:
    d += 1
  return d


def trees_of(decode_cfg, heads_cfg, k: int) -> tuple[Tree, ...]:
  """decode.adaptive_trees as Trees, checked against the decode options and the heads (k: the
  resolved K_max). Raises ConfigError naming the field."""
  d = decode_cfg
  name = "decode.adaptive_trees"
  for field, bad in (("adaptive", not d.adaptive), ("drafter", d.drafter != "heads"),
                     ("confidence_threshold", d.confidence_threshold > 0)):
    if bad:
      raise ConfigError(f"decode.{field}={getattr(d, field)!r}: {name} needs adaptive k "
                        "drafting with the heads and no confidence threshold")
  if heads_cfg.kind != "parallel":
    raise ConfigError(f"heads.kind={heads_cfg.kind!r}: {name} needs parallel heads")
  trees = []
  for choices in d.adaptive_trees:
    try:
      tree = Tree.from_choices(choices)
      tree.check_heads(k)
    except (shapes.ShapeError, TypeError) as e:
      raise ConfigError(f"{name}: {e}") from None
    if chain_depth(tree) == tree.size:
      raise ConfigError(f"{name}: {tree.choices} is a chain (a chain is always a candidate)")
    trees.append(tree)
  if d.tree_rates:
    try:
      rates = shapes.check_rates(d.tree_rates)
    except shapes.ShapeError as e:
      raise ConfigError(f"decode.tree_rates: {e}") from None
    if len(rates) < k:
      raise ConfigError(f"decode.tree_rates: {len(rates)} heads' rates, k={k} needed")
  return tuple(trees)


def make(decode_cfg, heads_cfg) -> ShapeSet:
  """The shape set of a resolved adaptive DecodeConfig."""
  k = decode_cfg.k
  trees = trees_of(decode_cfg, heads_cfg, k) if decode_cfg.adaptive_trees else ()
  top = max((t.top_k for t in trees), default=1)
  rates = decode_cfg.tree_rates or shapes.prior_rates(k, max(top, 2))
  return ShapeSet(kd=k, trees=trees, rates=tuple(tuple(r) for r in rates))


def auto_options(heads_cfg, model_dir: str | None, options: dict,
                 budgets=ADAPTIVE_BUDGETS) -> dict:
  """The DecodeConfig options that let adaptive k choose among the trees of a model with
  parallel heads drafting alone (none where `options` pick another drafter or a confidence
  threshold): its trees for `budgets` (shapes.tree_for: model_dir/trees.json's, else built from
  its rates, else the default), chains left out, and its measured rates."""
  if (heads_cfg.kind != "parallel" or options.get("drafter", "heads") != "heads"
      or options.get("confidence_threshold", 0.0) > 0 or options.get("k", -1) == 0):
    return {}
  trees = []
  for b in budgets:
    tree = shapes.tree_for(b, heads_cfg.num, model_dir)
    if chain_depth(tree) < tree.size and tree.choices not in trees:
      trees.append(tree.choices)
  path = os.path.join(model_dir, shapes.TREES_FILE) if model_dir else None
  rates = shapes.load_trees(path)[0] if path and os.path.exists(path) else None
  return {"adaptive_trees": tuple(trees),
          "tree_rates": () if rates is None else tuple(tuple(r) for r in rates[:heads_cfg.num])}


def resolve(cfg: DecodeConfig, model: ModelConfig, heads: HeadsConfig) -> DecodeConfig:
  """The decode options an engine runs: the defaults filled from the model (max_len, k, the
  reuse of a single sequential module) and every value checked against the model and the heads,
  a fixed tree and adaptive k's trees included. Raises ConfigError naming the field."""
  max_len = cfg.max_len or model.max_seq_len
  if max_len > model.max_seq_len:
    fail("decode.max_len", cfg.max_len, f"must be <= model.max_seq_len={model.max_seq_len}")
  k = heads.num if cfg.k == -1 else cfg.k
  span = k                  # inputs a step adds past the last committed token
  if cfg.tree:
    tree = shapes.decode_tree(cfg, heads)
    k, span = tree.max_depth, tree.size
  if cfg.adaptive_trees:    # checked here; a tree is chosen only where rows have room
    trees_of(cfg, heads, k)
  reuse = cfg.reuse_module or (heads.kind == "sequential" and heads.num == 1 and k > 1
                               and cfg.drafter == "heads")   # one module: the only way
  if cfg.reuse_module and (heads.kind != "sequential" or cfg.drafter != "heads"):
    fail("decode.reuse_module", True, "needs sequential heads (heads.kind='sequential') "
         "drafting (decode.drafter='heads')")
  if k > heads.num and cfg.drafter == "heads" and not reuse:
    fail("decode.k", cfg.k, f"must be <= heads.num={heads.num}"
         + (" (or set decode.reuse_module)" if heads.kind == "sequential" else ""))
  if max_len <= span + 1:
    fail("decode.max_len", max_len, f"must be > {'tree nodes' if cfg.tree else 'k'} + 1 = "
         f"{span + 1}")
  return dataclasses.replace(cfg, max_len=max_len, k=k, reuse_module=reuse,
                             prefill_rows=min(cfg.prefill_rows, cfg.batch_size))
