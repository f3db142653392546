"""A whole tree step on the trunk, drafts given: the step's inputs and rotary positions by
depth, one pass under the ancestor mask, greedy verify, the accepted path's K/V commit. What the
engine's step does with a tree, checked against plain passes and plain greedy decoding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.decoding import shapes as S
from mtp_jax.decoding import tree_verify as TV
from mtp_jax.models import cache as kv
from mtp_jax.models import model as M
from mtp_jax.training import generate
from tests.conftest import tiny_config

# Node order: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0) (0,0,1)
CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]

@functools.partial(jax.jit, static_argnums=(0, 1))
def _trunk_tree_step(graphdef, tree, params, cache, last_B, length_B, cands_BKR):
  """What the engine's step does with a tree (drafts given): inputs, one trunk pass under the
  ancestor mask, greedy verify, the accepted path's K/V moved into place."""
  m = M.bind(graphdef, params)
  nodes_BT = TV.node_tokens(tree, cands_BKR)
  tokens, pos = TV.step_inputs(tree, last_B, nodes_BT, length_B)
  h, cache = m(tokens, pos, cache, query_mask_TT=tree.mask_PP)
  logits_BPV = m.logits(h)
  verdict = TV.verify_greedy(tree, nodes_BT, logits_BPV)
  cache = TV.commit_path_cache(cache, length_B, verdict.path_BD, verdict.accepted_B)
  return verdict, cache, logits_BPV, nodes_BT


@functools.partial(jax.jit, static_argnums=0)
def _plain_logits(graphdef, params, tokens_NS, last_N):
  """The trunk's logits at position last_N of each sequence, one causal pass, no cache."""
  m = M.bind(graphdef, params)
  n, s = tokens_NS.shape
  h, _ = m(tokens_NS, jnp.broadcast_to(jnp.arange(s), (n, s)))
  return m.logits(jnp.take_along_axis(h, last_N[:, None, None], 1)[:, 0])


def _check_against_paths(graphdef, params, tree, out, nodes_BT, logits_BPV):
  """The step's logits at the root and at every node equal a plain pass over the row's
  committed tokens followed by that node's path."""
  seqs, lasts = [], []
  for row, committed in enumerate(out):
    for path in [np.zeros(0, int)] + [p[p >= 0] for p in tree.paths_TD]:
      seq = list(committed) + nodes_BT[row, path].tolist()
      seqs.append(seq + [0] * (64 - len(seq)))
      lasts.append(len(seq) - 1)
  want = _plain_logits(graphdef, params, jnp.asarray(seqs, jnp.int32), jnp.asarray(lasts))
  np.testing.assert_allclose(np.asarray(logits_BPV).reshape(want.shape), want, atol=2e-4)


def _oracle_candidates(rng, truth_BK, top_k, v):
  """Per head, top_k distinct tokens with the true one at a random rank, or absent."""
  b, k = truth_BK.shape
  out = np.zeros((b, k, top_k), np.int32)
  for row in range(b):
    for d in range(k):
      others = rng.permutation(np.setdiff1d(np.arange(v), [truth_BK[row, d]]))[:top_k]
      rank = rng.integers(0, top_k + 1)
      if rank < top_k:
        others[rank] = truth_BK[row, d]
      out[row, d] = others
  return out


def test_tree_decoding_on_the_trunk_equals_plain_greedy():
  """Rows at different lengths; drafts put the right token at random ranks (or nowhere), so
  paths through later ranks get accepted. Every step's logits at every node equal a plain pass
  over the node's path, and the output is plain greedy decoding's, token for token: the mask,
  the rotary positions and the K/V commit are all right."""
  cfg = tiny_config(model={"dtype": "float32"})
  graphdef, params = M.split(M.create(cfg.model, cfg.heads, 0))
  tree = S.Tree.from_choices(CHOICES)
  v, b, new = cfg.model.vocab_size, 2, 24
  rng = np.random.default_rng(0)
  lengths = np.array([5, 11])
  prompt = rng.integers(0, v, (b, 11)).astype(np.int32)
  with jax.default_matmul_precision("highest"):
    ref = np.asarray(generate.greedy_generate(graphdef, params, jnp.asarray(prompt),
                                              jnp.asarray(lengths), new + 4))
    cache = kv.init_cache(cfg.model, b, 64)
    _, cache = M.bind(graphdef, params)(jnp.asarray(prompt),
                                        jnp.broadcast_to(jnp.arange(11), (b, 11)), cache)
    out = [list(prompt[row, :lengths[row]]) for row in range(b)]
    length, accepted, ranks = lengths.copy(), [], []
    while min(len(o) - n for o, n in zip(out, lengths)) < new:
      truth = np.stack([ref[row, length[row]:length[row] + tree.max_depth] for row in range(b)])
      cands = _oracle_candidates(rng, truth, tree.top_k, v)
      last = np.array([o[-1] for o in out], np.int32)
      verdict, cache, logits, nodes = _trunk_tree_step(
          graphdef, tree, params, cache, jnp.asarray(last), jnp.asarray(length),
          jnp.asarray(cands))
      _check_against_paths(graphdef, params, tree, out, np.asarray(nodes), logits)
      n, tokens = np.asarray(verdict.accepted_B), np.asarray(verdict.tokens_BD)
      for row in range(b):
        out[row] += tokens[row, :n[row] + 1].tolist()
      length += n + 1
      accepted += n.tolist()
      ranks += tree.rank[np.asarray(verdict.path_BD)[np.asarray(verdict.path_BD) >= 0]].tolist()
  for row in range(b):
    got = out[row][lengths[row]:lengths[row] + new]
    assert got == ref[row, lengths[row]:lengths[row] + new].tolist(), row
  assert max(accepted) == tree.max_depth and min(accepted) == 0 and max(ranks) > 0
