"""Draft shapes: a chain of k drafts, or a static token tree; trees from measured acceptance.

A tree is Medusa's "choices": a set of paths of candidate ranks. Path (r_1, .., r_d) is the node
holding rank r_d of head d's candidates under the node (r_1, .., r_{d-1}); (0,) is head 1's best
token, (1, 0) head 2's best token after head 1's second. Nodes are numbered by depth, then by path,
so a node's ancestors always come before it. A step verifies [last committed token (the root),
T nodes] in one pass; everything the step needs is turned once, on the host, into numpy arrays:

  parent [T]        parent node index, -1 for the root token
  depth [T]         1 for the root's children; the root input token has depth 0
  head [T], rank [T]  the node token's source: rank `rank` of head `head` (= depth - 1), 0-based
  mask_TT           node i attends node j iff j is i or an ancestor of i
  mask_PP           the same over the step's T+1 inputs (root first; every input attends the root)
  paths_TD          per node, its path root -> node as node indices, -1 padded to the max depth D
  retrieve_LD       the same for each leaf (Medusa's retrieve indices)
  children_PR       per input position (root 0, node i at i+1), its children by rank, -1 padded

Siblings must hold consecutive ranks from 0 ((1,) needs (0,)): a tree skipping a rank is never
better under ranked candidates, and the verify rule then tries children in rank order.

Trees from acceptance (Medusa, Cai et al. 2024, sec. 3.3.1): with rates[k][i] the probability that
rank i of head k+1 is the right token, a node's path is accepted with the product of its rates along
the path; the expected number of accepted drafts of a tree is the sum of that product over its
nodes (siblings hold distinct tokens, so at most one node per depth is accepted). Adding nodes
greedily by that product gives the best tree for a node budget under this model.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import json
import os
from typing import Iterable, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from mtp_jax.config import ConfigError

TREES_FILE = "trees.json"
TREES_FORMAT = "mtp-jax trees"
DEFAULT_BUDGETS = (4, 8, 16, 32)
DEFAULT_TOP_K = 8
# Prior rates when nothing was measured: rank-0 acceptance falling with the head's distance,
# ranks below sharing a fraction of what is left. A guess to start from, not a measurement.
_PRIOR_TOP1 = (0.7, 0.55, 0.45, 0.38, 0.33, 0.3, 0.27, 0.25)
_PRIOR_RANK_DECAY = 0.35


class ShapeError(ValueError):
  """An invalid draft shape, tree file or rate table; the message names the path or field."""


@dataclasses.dataclass(frozen=True)
class Chain:
  """k drafts in a line: each head's best token (k = 0 is plain decoding)."""
  k: int

  def __post_init__(self):
    if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
      raise ShapeError(f"Chain(k={self.k!r}): k must be an integer >= 0")

  @property
  def size(self) -> int:
    return self.k

  @property
  def name(self) -> str:
    return f"mtp:{self.k}"

  def as_tree(self) -> "Tree":
    return Tree.from_choices([(0,) * d for d in range(1, self.k + 1)])


@dataclasses.dataclass(frozen=True, eq=True)
class Tree:
  """A static token tree; hashable, so it can be a static argument of jit. Build it with
  `Tree.from_choices`; the arrays are computed once per tree and cached."""
  choices: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    _check_structure(self.choices)

  @classmethod
  def from_choices(cls, choices: Iterable[Sequence[int]], num_heads: int | None = None,
                   top_k: int | None = None) -> "Tree":
    paths = []
    for c in choices:
      if not isinstance(c, (list, tuple)):
        raise ShapeError(f"tree path {c!r}: must be a sequence of ranks")
      paths.append(tuple(c))
    tree = cls(tuple(sorted(paths, key=lambda p: (len(p), p))))
    tree.check_heads(num_heads, top_k)
    return tree

  def check_heads(self, num_heads: int | None, top_k: int | None = None) -> None:
    """Raises ShapeError if a path is deeper than the heads or asks a rank beyond their top-k."""
    for path in self.choices:
      if num_heads is not None and len(path) > num_heads:
        raise ShapeError(f"tree path {path}: depth {len(path)} is beyond the {num_heads} heads")
      if top_k is not None and max(path) >= top_k:
        raise ShapeError(f"tree path {path}: rank {max(path)} is beyond the heads' top-k={top_k}")

  @property
  def size(self) -> int:
    return len(self.choices)

  @property
  def name(self) -> str:
    return f"tree:{self.size}"

  @property
  def max_depth(self) -> int:
    return len(self.choices[-1])

  @property
  def top_k(self) -> int:
    """How many ranked candidates per head the tree reads."""
    return 1 + max(max(p) for p in self.choices)

  @functools.cached_property
  def parent(self) -> np.ndarray:
    index = {p: i for i, p in enumerate(self.choices)}
    return np.array([index[p[:-1]] if len(p) > 1 else -1 for p in self.choices], np.int32)

  @functools.cached_property
  def depth(self) -> np.ndarray:
    return np.array([len(p) for p in self.choices], np.int32)

  @property
  def head(self) -> np.ndarray:
    return self.depth - 1

  @functools.cached_property
  def rank(self) -> np.ndarray:
    return np.array([p[-1] for p in self.choices], np.int32)

  @functools.cached_property
  def paths_TD(self) -> np.ndarray:
    out = np.full((self.size, self.max_depth), -1, np.int32)
    for i in range(self.size):
      j = i
      while j >= 0:
        out[i, self.depth[j] - 1] = j
        j = self.parent[j]
    return out

  @functools.cached_property
  def mask_TT(self) -> np.ndarray:
    m = np.zeros((self.size, self.size), bool)
    for i, path in enumerate(self.paths_TD):
      m[i, path[path >= 0]] = True
    return m

  @functools.cached_property
  def mask_PP(self) -> np.ndarray:
    m = np.zeros((self.size + 1, self.size + 1), bool)
    m[:, 0] = True
    m[1:, 1:] = self.mask_TT
    return m

  @functools.cached_property
  def is_leaf(self) -> np.ndarray:
    leaf = np.ones(self.size, bool)
    leaf[self.parent[self.parent >= 0]] = False
    return leaf

  @property
  def retrieve_LD(self) -> np.ndarray:
    return self.paths_TD[self.is_leaf]

  @functools.cached_property
  def children_PR(self) -> np.ndarray:
    out = np.full((self.size + 1, self.top_k), -1, np.int32)
    out[self.parent + 1, self.rank] = np.arange(self.size, dtype=np.int32)
    return out[:, :max(1, int((out >= 0).sum(1).max()))]

  @property
  def offsets_P(self) -> np.ndarray:
    """Position of each of the step's T+1 inputs relative to the root token's position."""
    return np.concatenate([[0], self.depth]).astype(np.int32)


def _check_structure(choices) -> None:
  if not isinstance(choices, tuple):
    raise ShapeError("Tree(choices) takes a tuple of tuples (use Tree.from_choices)")
  if not choices:
    raise ShapeError("a tree needs at least one path")
  seen = set()
  for path in choices:
    if not isinstance(path, tuple) or not path:
      raise ShapeError(f"tree path {path!r}: must be a non-empty tuple of ranks")
    if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) or r < 0 for r in path):
      raise ShapeError(f"tree path {path}: ranks must be integers >= 0")
    if path in seen:
      raise ShapeError(f"tree path {path}: appears twice")
    seen.add(path)
  for path in choices:
    if len(path) > 1 and path[:-1] not in seen:
      raise ShapeError(f"tree path {path}: its prefix {path[:-1]} is not in the tree")
    if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in seen:
      raise ShapeError(f"tree path {path}: rank {path[-1]} needs its elder sibling "
                       f"{path[:-1] + (path[-1] - 1,)} in the tree")
  if list(choices) != sorted(choices, key=lambda p: (len(p), p)):
    raise ShapeError("tree paths must be ordered by depth, then path (use Tree.from_choices)")


def decode_tree(decode_cfg, heads_cfg) -> Tree:
  """The tree of a DecodeConfig (decode.tree), checked against the decode options and the heads:
  a fixed shape of the parallel heads' ranked candidates. Raises ConfigError naming the field."""
  d = decode_cfg
  try:
    tree = Tree(d.tree)
    tree.check_heads(heads_cfg.num)
  except ShapeError as e:
    raise ConfigError(f"decode.tree={d.tree!r}: {e}") from None
  if heads_cfg.kind != "parallel":
    raise ConfigError(f"heads.kind={heads_cfg.kind!r}: a tree (decode.tree) needs parallel "
                      "heads (sequential modules would run once per branch)")
  for name, bad in (("drafter", d.drafter != "heads"), ("adaptive", d.adaptive),
                    ("confidence_threshold", d.confidence_threshold > 0),
                    ("k", d.k not in (-1, tree.max_depth))):
    if bad:
      raise ConfigError(f"decode.{name}={getattr(d, name)!r}: not with a tree (decode.tree): a "
                        "tree is a fixed shape of the heads' candidates (drafter 'heads', no "
                        "adaptive k, no confidence threshold, k -1)")
  return tree


# ---------------------------------------------------------------- trees from acceptance rates


def check_rates(rates) -> tuple[tuple[float, ...], ...]:
  """rates[k][i]: P(rank i of head k+1 is the right token); validated, as tuples."""
  if not isinstance(rates, (list, tuple)) or not rates:
    raise ShapeError(f"rates={rates!r}: must be a non-empty list (one list per head)")
  out = []
  for k, row in enumerate(rates):
    if not isinstance(row, (list, tuple)) or not row:
      raise ShapeError(f"rates[{k}]={row!r}: must be a non-empty list of per-rank rates")
    row = tuple(float(x) for x in row)
    if any(not 0.0 <= x <= 1.0 for x in row) or sum(row) > 1.0 + 1e-6:
      raise ShapeError(f"rates[{k}]={list(row)}: each in [0, 1], summing to at most 1")
    out.append(row)
  return tuple(out)


def expected_accepted(tree: Tree, rates) -> float:
  """Expected drafts accepted per step under the rates (add 1 for tokens per step)."""
  rates = check_rates(rates)
  tree.check_heads(len(rates), min(len(r) for r in rates))
  return float(sum(_path_value(rates, p) for p in tree.choices))


def build_tree(rates, budget: int) -> Tree:
  """Medusa's greedy construction: from the root, add the node whose path is most likely to be
  accepted (a child of a chosen node, at its next free rank) until `budget` nodes."""
  rates = check_rates(rates)
  if not isinstance(budget, int) or budget < 1:
    raise ShapeError(f"budget={budget!r}: must be an integer >= 1")
  chosen = []
  frontier = [(-rates[0][0], (0,))]           # (-value, path): ties go to the smaller path
  while frontier and len(chosen) < budget:
    neg, path = heapq.heappop(frontier)
    chosen.append(path)
    d, r = len(path) - 1, path[-1]
    if r + 1 < len(rates[d]):                      # the next sibling
      sib = path[:-1] + (r + 1,)
      heapq.heappush(frontier, (-_path_value(rates, sib), sib))
    if d + 1 < len(rates):                         # the first child
      heapq.heappush(frontier, (-_path_value(rates, path + (0,)), path + (0,)))
  return Tree.from_choices(chosen)


def _path_value(rates, path) -> float:
  return float(np.prod([rates[d][r] for d, r in enumerate(path)]))


def prior_rates(num_heads: int, top_k: int = DEFAULT_TOP_K) -> tuple[tuple[float, ...], ...]:
  """The rates used where none were measured (see _PRIOR_TOP1)."""
  rows = []
  for k in range(num_heads):
    top1 = _PRIOR_TOP1[min(k, len(_PRIOR_TOP1) - 1)]
    rest = [(1 - top1) * _PRIOR_RANK_DECAY * (1 - _PRIOR_RANK_DECAY) ** i
            for i in range(top_k - 1)]
    rows.append((top1, *rest))
  return tuple(rows)


def default_tree(budget: int, num_heads: int, top_k: int = DEFAULT_TOP_K) -> Tree:
  """The tree for a budget when no rates were measured."""
  return build_tree(prior_rates(num_heads, top_k), budget)


# ---------------------------------------------------------------- model/trees.json


def save_trees(path: str, rates=None, trees: Mapping[int, Tree] | None = None) -> None:
  """Writes rates and/or trees (by budget) as JSON, through a temporary file and a rename."""
  doc = {"format": TREES_FORMAT, "version": 1}
  if rates is not None:
    doc["rates"] = [list(r) for r in check_rates(rates)]
  if trees:
    doc["trees"] = {str(int(b)): [list(p) for p in t.choices] for b, t in sorted(trees.items())}
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(doc, f, indent=1)
  os.replace(tmp, path)


def load_trees(path: str):
  """-> (rates or None, {budget: Tree}). Raises ShapeError naming the file and the field."""
  try:
    with open(path) as f:
      doc = json.load(f)
  except OSError as e:
    raise ShapeError(f"{path}: cannot read ({e.strerror})") from e
  except json.JSONDecodeError as e:
    raise ShapeError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(doc, dict) or doc.get("format") != TREES_FORMAT:
    raise ShapeError(f"{path}: not a trees file (format must be {TREES_FORMAT!r})")
  if doc.get("version") != 1:
    raise ShapeError(f"{path}: version {doc.get('version')!r} is not supported (1)")
  try:
    rates = check_rates(doc["rates"]) if "rates" in doc else None
    trees = {}
    for budget, choices in dict(doc.get("trees", {})).items():
      if not str(budget).isdigit() or not isinstance(choices, list):
        raise ShapeError(f"trees[{budget!r}]: needs a budget key and a list of paths")
      trees[int(budget)] = Tree.from_choices(choices)
      if trees[int(budget)].size > int(budget):
        raise ShapeError(f"trees[{budget!r}]: {trees[int(budget)].size} nodes exceed the budget")
  except (ShapeError, TypeError, ValueError) as e:
    raise ShapeError(f"{path}: {e}") from e
  return rates, trees


def tree_budget(spec) -> int | None:
  """The node budget T of a draft-shape spec 'tree:T' (the k of Decoder.load, mtp-infer's --k,
  mtp-bench's modes); None for any other spec. Raises ShapeError for a malformed 'tree:...'."""
  if not (isinstance(spec, str) and spec.startswith("tree:")):
    return None
  t = spec[len("tree:"):]
  if not t.isdigit() or int(t) < 1:
    raise ShapeError(f"{spec!r}: a tree is tree:T with T >= 1 nodes")
  return int(t)


def tree_for(budget: int, num_heads: int, model_dir: str | None = None,
             top_k: int | None = None) -> Tree:
  """The tree for a node budget: the one stored in model_dir/trees.json for that budget, else
  one built from the rates stored there, else the default. Checked against the heads."""
  path = os.path.join(model_dir, TREES_FILE) if model_dir else None
  rates, trees = load_trees(path) if path and os.path.exists(path) else (None, {})
  if budget in trees:
    tree = trees[budget]
  elif rates is not None:
    tree = build_tree([r[:top_k] for r in rates[:num_heads]], budget)
  else:
    tree = default_tree(budget, num_heads, top_k or DEFAULT_TOP_K)
  tree.check_heads(num_heads, top_k)
  return tree


# ---------------------------------------------------------------- measuring the rates


def topk_hits(head_logits_BTKV, targets_BTK, valid_BTK, top_k: int, conditional: bool = True):
  """Per head, how often each rank of its candidates is the target (jittable).

  head_logits_BTKV: head k's logits at position t (predicting token t+2+k); targets_BTK the tokens
  verification would compare with there (the trunk's own greedy tokens, or the text); valid_BTK
  where a target exists. conditional: count head k only where every earlier head's target is
  within its top_k (the event that the tree has the path at all), which is the rate the tree's
  product model needs. -> (hits [K, top_k], trials [K]) int32; rates = hits / trials.
  """
  logits = head_logits_BTKV.astype(jnp.float32)
  target_logit = jnp.take_along_axis(logits, targets_BTK[..., None], -1)
  rank_BTK = jnp.sum(logits > target_logit, -1)        # ties rank the target first
  valid = valid_BTK.astype(bool)
  if conditional:
    inside = ((rank_BTK < top_k) & valid).astype(jnp.int32)
    earlier = jnp.concatenate([jnp.ones_like(inside[..., :1]),
                               jnp.cumprod(inside, axis=-1)[..., :-1]], -1)
    valid = valid & (earlier > 0)
  onehot = (rank_BTK[..., None] == jnp.arange(top_k)) & valid[..., None]
  hits = jnp.sum(onehot, axis=(0, 1)).astype(jnp.int32)
  trials = jnp.sum(valid, axis=(0, 1)).astype(jnp.int32)
  return hits, trials


def rates_from_hits(hits_KR, trials_K) -> tuple[tuple[float, ...], ...]:
  """Host: counts (summed over batches) -> rates for build_tree."""
  hits, trials = np.asarray(hits_KR, np.float64), np.asarray(trials_K, np.float64)
  return tuple(tuple(float(x) for x in row / max(n, 1.0)) for row, n in zip(hits, trials))
