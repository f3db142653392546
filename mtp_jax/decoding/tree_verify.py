"""Verifying a token tree in one step, and committing the accepted path's K/V.

The step's inputs are the root (the last committed token, at position length-1) and the tree's T
nodes (node i at position length-1+depth[i], its K/V written at the tree slot length+i). The
trunk's distributions come at the T+1 inputs: position 0 is the root's, position i+1 node i's, and
the distribution at a position is the one for that input's children.

Greedy: keep the deepest node whose path agrees with the trunk's argmax at every parent, then the
trunk's argmax there: exactly the tokens plain greedy decoding emits.

Sampling: recursive rejection (SpecInfer, Miao et al. 2024; EAGLE). From the root, with p the
trunk's distribution at the current node, try its children in rank order: child x_r is proposed
from a distribution q_r and accepted with probability min(1, p(x_r) / q_r(x_r)); on acceptance go
down to x_r (p becomes the trunk's distribution there); on rejection p <- norm(max(0, p - q_r))
and try the next child; when no child is left (or the node is a leaf), draw the bonus token from
the current p. Each try is the rejection step of Leviathan et al.: if x ~ q_r, the try emits x with
probability min(p, q_r)(x) and otherwise hands over to norm(max(0, p - q_r)), so "try, then sample
from the residual" samples p exactly. Replacing the residual draw by another try on the residual
keeps this, by induction over the children, as long as each child is really drawn from its q_r
given what came before and independently of the acceptance coins. So what q_r is depends on how
the drafts were made, and a wrong q breaks losslessness:

  'topk' (deterministic drafts: the heads' top-k tokens): x_r is fixed, so q_r is the point mass
      on x_r: accept with probability p(x_r), on rejection remove x_r from p and renormalise. This
      is EAGLE's rule (evaluate_posterior: qx = 1, gtp[xi] = 0, renormalise) and SGLang's
      target-only tree sampling (one coin per depth against the running sum of the children's p:
      the same law). It holds for any drafts chosen independently of the coins, duplicates
      included (a repeated token has p = 0 once removed). Using the head's own probabilities as q
      for top-k drafts is NOT lossless: a top-1 draft with q(x) = p(x) = 0.5 would always be
      accepted.
  'sampled' (each parent's children drawn without replacement from the head's processed q, in
      rank order: `draw_candidates`, Gumbel top-k): q_r is q with the earlier siblings' tokens
      removed and renormalised (recursive rejection sampling without replacement, Jeon et al.
      2024). When q has no mass left the later "draws" are arbitrary tokens and use the point
      mass, as in 'topk'. Medusa-style heads draw once per depth and every parent at that depth
      shares the draws: still a fresh draw for whichever parent the walk reaches.
Greedy rows in a sampling batch have one-hot p and reduce to the greedy rule under both modes.

Committing: the accepted nodes' K/V sit at tree slots length+path[d]; `commit_path` moves them to
length+d (a gather of at most D entries per row and cache array), so the row's cache holds the
accepted tokens at their positions; entries past the new length are never read.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.decoding import sampling
from mtp_jax.decoding.sampling import NEG_INF, row_keys
from mtp_jax.decoding.shapes import Tree

MODES = ("topk", "sampled")


class Verdict(NamedTuple):
  """Per row: n drafts accepted, their node indices (-1 past n), the emitted tokens (the first
  n are the accepted drafts, token n is the trunk's bonus, later ones mean nothing), and the
  input position (0 = root, i+1 = node i) of the last accepted token, whose hidden state drafts
  the next step."""
  accepted_B: jax.Array      # [B] int32
  path_BD: jax.Array         # [B, D] int32
  tokens_BD: jax.Array       # [B, D+1] int32
  last_B: jax.Array          # [B] int32

  @property
  def bonus_B(self):
    return jnp.take_along_axis(self.tokens_BD, self.accepted_B[:, None], 1)[:, 0]


# ---------------------------------------------------------------- drafting the tree's tokens


def topk_candidates(head_logits_BKV, top_k: int):
  """[B, K, top_k] each head's best tokens, best first (deterministic drafts, mode 'topk')."""
  return jax.lax.top_k(head_logits_BKV, top_k)[1].astype(jnp.int32)


def draw_candidates(key, head_logq_BKV, top_k: int):
  """[B, K, top_k] tokens drawn without replacement from each head's processed q, in draw order
  (Gumbel top-k; mode 'sampled'). `key` is one key or one per row."""
  b = head_logq_BKV.shape[0]
  gumbel = jax.vmap(lambda k: jax.random.gumbel(k, head_logq_BKV.shape[1:]))(row_keys(key, b))
  return jax.lax.top_k(head_logq_BKV + gumbel, top_k)[1].astype(jnp.int32)


def node_tokens(tree: Tree, candidates_BKR):
  """[B, T] the tree's tokens: node i takes rank rank[i] of head head[i]."""
  return candidates_BKR[:, tree.head, tree.rank]


def head_rows(tree: Tree, num_heads: int):
  """[T+1] for parallel heads: per input position, the head its children were drawn from (head
  d for every node at depth d-1; the root's children come from head 1), as `q_row_P` of
  verify_sampling over the heads' [B, K, V] distributions."""
  return jnp.asarray(tree.offsets_P.clip(0, num_heads - 1))


def step_inputs(tree: Tree, last_token_B, nodes_BT, length_B):
  """-> (tokens [B, T+1], positions [B, T+1]) of the verify step: the root at length-1, each
  node at length-1+depth. Its K/V go to slots length-1 .. length-1+T."""
  tokens = jnp.concatenate([last_token_B[:, None], nodes_BT], 1).astype(jnp.int32)
  return tokens, (length_B[:, None] - 1 + tree.offsets_P[None]).astype(jnp.int32)


def step_presence(tree: Tree, base_BV, nodes_BT):
  """[B, T+1, V] the tokens the repetition penalty counts at each input position: the row's
  history (base_BV, `sampling.presence`) plus the tokens of that node's own path, as plain
  decoding would have emitted them; siblings and other branches do not count."""
  onehot_BTV = jax.nn.one_hot(nodes_BT, base_BV.shape[-1], dtype=jnp.float32)
  on_path_BTV = jnp.einsum("ij,BjV->BiV", tree.mask_TT.astype(np.float32), onehot_BTV) > 0
  return jnp.concatenate([base_BV[:, None], base_BV[:, None] | on_path_BTV], axis=1)


# ---------------------------------------------------------------- verification


def _emitted(nodes_BT, path_BD, n_B, bonus_B):
  d = path_BD.shape[1]
  drafts = jnp.take_along_axis(nodes_BT, jnp.maximum(path_BD, 0), 1)
  tokens = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], 1)
  return jnp.where(jnp.arange(d + 1)[None] == n_B[:, None], bonus_B[:, None], tokens)


def verify_greedy(tree: Tree, nodes_BT, logits_BPV, limit_B=None) -> Verdict:
  """The longest path whose every token is the trunk's argmax at its parent, then the argmax at
  its end. logits_BPV: the trunk's logits at the root and every node [B, T+1, V]. The argmax is
  taken only where it is read: at positions with children, then at each row's last accepted one
  (about half a tree's nodes are leaves; an argmax over V is no cheap reduction on XLA:CPU).
  limit_B: per row, no node deeper than this is accepted (default: none is cut)."""
  inner_I = np.flatnonzero(tree.children_PR[:, 0] >= 0)         # the root always has children
  slot_P = np.zeros(tree.size + 1, np.int32)
  slot_P[inner_I] = np.arange(len(inner_I))
  target_BI = sampling.argmax(logits_BPV[:, inner_I])
  match_BT = nodes_BT == target_BI[:, slot_P[tree.parent + 1]]
  ok_BT = ~jnp.any(tree.mask_TT[None] & ~match_BT[:, None, :], -1)   # every ancestor matches
  if limit_B is not None:
    ok_BT = ok_BT & (tree.depth[None] <= limit_B[:, None])
  t = tree.size
  score_BT = jnp.where(ok_BT, tree.depth * (t + 1) + (t - jnp.arange(t)), 0)
  best_B = jnp.argmax(score_BT, -1)
  hit_B = jnp.any(ok_BT, -1)
  n_B = jnp.where(hit_B, jnp.asarray(tree.depth)[best_B], 0).astype(jnp.int32)
  path_BD = jnp.where(hit_B[:, None], jnp.asarray(tree.paths_TD)[best_B], -1)
  last_B = jnp.where(hit_B, best_B + 1, 0).astype(jnp.int32)
  rows = jnp.arange(nodes_BT.shape[0])
  bonus_B = sampling.argmax(logits_BPV[rows, last_B])
  return Verdict(n_B, path_BD, _emitted(nodes_BT, path_BD, n_B, bonus_B), last_B)


def _normalized(x_BV, fallback_BV):
  mass = jnp.sum(x_BV, -1, keepdims=True)
  return jnp.where(mass > 0, x_BV / jnp.maximum(mass, 1e-30), fallback_BV)


def verify_sampling(key, tree: Tree, nodes_BT, logp_BPV, logq_BXV=None, q_row_P=None,
                    mode: str = "topk", limit_B=None) -> Verdict:
  """Lossless recursive rejection over the tree (see the module docstring for the modes).

  logp_BPV: the trunk's processed log-probabilities at the root and every node [B, T+1, V].
  'sampled' only: logq_BXV the processed log q the drafts were drawn from, and q_row_P [T+1]
  which of its X rows each input position's children were drawn from (default: row = position,
  X = T+1; parallel heads pass their [B, K, V] and `head_rows`). `key`: one key or one per row.
  Only the rows the walk reaches are exponentiated, never all T+1 positions' distributions.
  limit_B: per row, the depth past which no child is tried (the walk stops there and draws the
  bonus token from the current p, as at a leaf).
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: must be one of {MODES}")
  if mode == "sampled" and logq_BXV is None:
    raise ValueError("mode 'sampled' needs logq_BXV, the distributions the drafts were drawn from")
  b, t = nodes_BT.shape
  v = logp_BPV.shape[-1]
  d_max, r_max = tree.max_depth, tree.children_PR.shape[1]
  children_PR = jnp.asarray(tree.children_PR)
  keys = jax.vmap(lambda k: jax.random.split(k, 2))(row_keys(key, b))
  u_BDR = jax.vmap(lambda k: jax.random.uniform(k, (d_max, r_max)))(keys[:, 0])
  q_row_P = jnp.arange(t + 1) if q_row_P is None else jnp.asarray(q_row_P)
  rows = jnp.arange(b)
  p_at = lambda pos_B: jnp.exp(logp_BPV[rows, pos_B].astype(jnp.float32))
  vocab = jnp.arange(v)

  def try_child(d, pos_B, live_B):
    def body(r, carry):
      p, q_left, taken, chosen = carry
      child = children_PR[pos_B, r]
      trying = live_B & ~taken & (child >= 0)
      x = nodes_BT[rows, jnp.maximum(child, 0)]
      is_x = vocab[None] == x[:, None]
      q_r = is_x.astype(jnp.float32)                       # point mass ('topk')
      if q_left is not None:                               # 'sampled': q less the tried tokens
        q_r = _normalized(q_left, q_r)
        q_left = jnp.where(trying[:, None] & is_x, 0.0, q_left)
      px, qx = p[rows, x], q_r[rows, x]
      accept = trying & (u_BDR[:, d, r] * qx < px)
      reject = trying & ~accept
      p = jnp.where(reject[:, None], _normalized(jnp.maximum(p - q_r, 0.0), p), p)
      return p, q_left, taken | accept, jnp.where(accept, child, chosen)
    return body

  def depth_body(d, carry):
    pos_B, p, live_B, n_B, path_BD = carry
    if limit_B is not None:
      live_B = live_B & (d < limit_B)
    q0 = None
    if mode == "sampled":
      q0 = jnp.exp(logq_BXV[rows, q_row_P[pos_B]].astype(jnp.float32))
    init = (p, q0, jnp.zeros((b,), bool), jnp.full((b,), -1, jnp.int32))
    p, _, taken, chosen = jax.lax.fori_loop(0, r_max, try_child(d, pos_B, live_B), init)
    path_BD = jnp.where((jnp.arange(d_max)[None] == d) & taken[:, None], chosen[:, None], path_BD)
    pos_B = jnp.where(taken, chosen + 1, pos_B)
    p = jnp.where(taken[:, None], p_at(pos_B), p)
    return pos_B, p, live_B & taken, n_B + taken, path_BD

  init = (jnp.zeros((b,), jnp.int32), p_at(jnp.zeros((b,), jnp.int32)), jnp.ones((b,), bool),
          jnp.zeros((b,), jnp.int32), jnp.full((b, d_max), -1, jnp.int32))
  last_B, p, _, n_B, path_BD = jax.lax.fori_loop(0, d_max, depth_body, init)
  logits = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), NEG_INF)
  bonus_B = jax.vmap(lambda k, lg: jax.random.categorical(k, lg))(keys[:, 1], logits)
  bonus_B = bonus_B.astype(jnp.int32)
  return Verdict(n_B, path_BD, _emitted(nodes_BT, path_BD, n_B, bonus_B), last_B)


def chain_accepted(tree: Tree, path_BD):
  """[B] how many of the accepted path's first nodes hold rank 0: the drafts the tree's rank-0
  chain accepted (greedy: exactly what a chain step would have; sampling: in law, as each
  depth tries rank 0 first with the chain's rule)."""
  rank0_BD = (path_BD >= 0) & (jnp.asarray(tree.rank)[jnp.maximum(path_BD, 0)] == 0)
  return jnp.sum(jnp.cumprod(rank0_BD.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


# ---------------------------------------------------------------- committing the accepted path


def commit_path(buf_BS, length_B, path_BD, accepted_B):
  """Moves each row's accepted nodes from their tree slots length+path[d] to length+d, d < n.

  buf_BS: any cache array indexed [B, S, ...] (K, V, their scales). Only the n moved entries are
  written (the rest drop out of bounds), so with the buffer donated XLA updates it in place.
  """
  b, s = buf_BS.shape[:2]
  d = path_BD.shape[1]
  rows = jnp.arange(b)[:, None]
  src = jnp.clip(length_B[:, None] + jnp.maximum(path_BD, 0), 0, s - 1)
  moved = buf_BS[rows, src]                                    # [B, D, ...]
  keep = jnp.arange(d)[None] < accepted_B[:, None]
  dst = jnp.where(keep, length_B[:, None] + jnp.arange(d)[None], s)
  return buf_BS.at[rows, dst].set(moved, mode="drop")


def commit_path_cache(cache, length_B, path_BD, accepted_B):
  """commit_path on every array of a cache pytree (KVCache: k, v and scales of every layer)."""
  return jax.tree.map(lambda a: commit_path(a, length_B, path_BD, accepted_B), cache)
