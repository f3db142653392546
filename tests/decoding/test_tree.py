"""Token trees: static shapes from choices, greedy and lossless sampling verification, tree
construction from acceptance rates, the trees file, and the accepted path's K/V commit."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

from mtp_jax.decoding import sampling
from mtp_jax.decoding import shapes as S
from mtp_jax.decoding import tree_verify as TV

# Node order: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0) (0,0,1)
CHOICES = [(0, 0, 1), (1,), (0,), (0, 1), (2,), (0, 0), (1, 0), (0, 0, 0)]


def _tree():
  return S.Tree.from_choices(CHOICES)


def test_shapes_from_choices_by_hand():
  tree = _tree()
  assert tree.choices == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1))
  assert tree.size == 8 and tree.max_depth == 3 and tree.top_k == 3 and tree.name == "tree:8"
  assert tree.parent.tolist() == [-1, -1, -1, 0, 0, 1, 3, 3]
  assert tree.depth.tolist() == [1, 1, 1, 2, 2, 2, 3, 3]
  assert tree.head.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
  assert tree.rank.tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
  assert tree.offsets_P.tolist() == [0, 1, 1, 1, 2, 2, 2, 3, 3]
  assert tree.paths_TD.tolist() == [[0, -1, -1], [1, -1, -1], [2, -1, -1], [0, 3, -1],
                                    [0, 4, -1], [1, 5, -1], [0, 3, 6], [0, 3, 7]]
  assert tree.retrieve_LD.tolist() == [[2, -1, -1], [0, 4, -1], [1, 5, -1], [0, 3, 6], [0, 3, 7]]
  assert tree.children_PR.tolist() == [[0, 1, 2], [3, 4, -1], [5, -1, -1], [-1, -1, -1],
                                       [6, 7, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1],
                                       [-1, -1, -1]]
  attends = lambda i: set(np.flatnonzero(tree.mask_TT[i]).tolist())
  assert attends(0) == {0} and attends(5) == {1, 5} and attends(7) == {0, 3, 7}
  assert tree.mask_TT.sum() == 8 + 7              # itself, then 0,0,0,1,1,1,2,2 ancestors
  # The step's mask: the root sees itself only, each node the root and its own path.
  assert tree.mask_PP[0].tolist() == [True] + [False] * 8
  assert np.flatnonzero(tree.mask_PP[8]).tolist() == [0, 1, 4, 8]
  chain = S.Chain(3).as_tree()
  assert chain.choices == ((0,), (0, 0), (0, 0, 0)) and chain.parent.tolist() == [-1, 0, 1]
  assert S.Chain(3).name == "mtp:3"


def test_trees_are_static_arguments():
  a, b = _tree(), S.Tree.from_choices(sorted(CHOICES))
  assert a == b and hash(a) == hash(b) and a != S.Chain(3).as_tree()
  f = jax.jit(lambda tree, x: x + tree.size, static_argnums=0)
  assert int(f(a, 1)) == 9 and int(f(b, 1)) == 9


@pytest.mark.parametrize("choices, heads, top_k, message", [
    ([(0,), (1, 0)], None, None, "tree path (1, 0): its prefix (1,) is not in the tree"),
    ([(0,), (0, 0), (0, 0, 0), (1, 1, 0)], None, None, "(1, 1, 0): its prefix (1, 1)"),
    ([(0,), (2,)], None, None, "tree path (2,): rank 2 needs its elder sibling (1,)"),
    ([(0,), (1,), (0, 0), (0, 1), (0, 1, 0), (0, 1, 0, 0)], 3, None,
     "tree path (0, 1, 0, 0): depth 4 is beyond the 3 heads"),
    ([(0,), (1,), (2,), (0, 0)], None, 2, "tree path (2,): rank 2 is beyond the heads' top-k=2"),
    ([(0,), (0,)], None, None, "tree path (0,): appears twice"),
    ([(0,), ()], None, None, "tree path (): must be a non-empty tuple"),
    ([(0,), (-1,)], None, None, "tree path (-1,): ranks must be integers >= 0"),
    ([], None, None, "at least one path"),
])
def test_invalid_choices_raise_naming_the_path(choices, heads, top_k, message):
  with pytest.raises(S.ShapeError) as e:
    S.Tree.from_choices(choices, num_heads=heads, top_k=top_k)
  assert message in str(e.value)


def test_invalid_chain():
  with pytest.raises(S.ShapeError, match="Chain"):
    S.Chain(-1)
  with pytest.raises(S.ShapeError, match="from_choices"):
    S.Tree([(0,)])


# ---------------------------------------------------------------- greedy


def _one_hot_logits(targets_BP, v):
  return jax.nn.one_hot(jnp.asarray(targets_BP), v) * 10.0


def test_greedy_keeps_the_longest_agreeing_path():
  tree = _tree()
  v = 20
  # Node tokens (same order as the choices): (0,)=1 (1,)=2 (2,)=3 (0,0)=4 (0,1)=5 (1,0)=6
  # (0,0,0)=7 (0,0,1)=8.
  nodes = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]] * 4)
  targets = np.full((4, 9), 19)
  targets[0, [0, 2, 6]] = [2, 6, 11]      # root -> (1,) -> (1,0) -> bonus 11: not rank 0
  targets[1, [0, 1, 4]] = [1, 4, 8]       # root -> (0,) -> (0,0) -> (0,0,1) (a leaf) -> 19
  targets[2, 0] = 9                       # nothing agrees: the trunk's token only
  targets[3, [0, 1]] = [1, 5]             # (0,) -> (0,1), a leaf at depth 2 -> 19
  out = jax.jit(TV.verify_greedy, static_argnums=0)(tree, nodes, _one_hot_logits(targets, v))
  assert out.accepted_B.tolist() == [2, 3, 0, 2]
  assert out.path_BD.tolist() == [[1, 5, -1], [0, 3, 7], [-1, -1, -1], [0, 4, -1]]
  assert out.tokens_BD[0, :3].tolist() == [2, 6, 11]
  assert out.tokens_BD[1].tolist() == [1, 4, 8, 19]
  assert out.tokens_BD[2, 0] == 9 and out.tokens_BD[3, :3].tolist() == [1, 5, 19]
  assert out.bonus_B.tolist() == [11, 19, 9, 19]
  assert out.last_B.tolist() == [6, 8, 0, 5]


def test_greedy_chain_tree_is_the_chain_rule():
  k, v, b = 3, 4, 256
  rng = np.random.default_rng(0)
  drafts = jnp.asarray(rng.integers(0, v, (b, k)), jnp.int32)
  logits = jnp.asarray(rng.normal(size=(b, k + 1, v)), jnp.float32)
  n_chain, tokens_chain = sampling.verify_greedy(drafts, logits)
  out = jax.jit(TV.verify_greedy, static_argnums=0)(S.Chain(k).as_tree(), drafts, logits)
  np.testing.assert_array_equal(out.accepted_B, n_chain)
  assert (n_chain > 0).any() and (n_chain == 0).any()
  valid = np.arange(k + 1)[None] <= np.asarray(n_chain)[:, None]
  np.testing.assert_array_equal(np.where(valid, out.tokens_BD, -1),
                                np.where(valid, tokens_chain, -1))


@pytest.mark.parametrize("mode", TV.MODES)
def test_sampling_rule_on_one_hot_rows_is_the_greedy_rule(mode):
  tree, v, b = _tree(), 6, 64
  rng = np.random.default_rng(1)
  # Siblings hold distinct tokens (ranked candidates do): each head's ranks a permutation.
  cands = np.stack([[rng.permutation(3) for _ in range(3)] for _ in range(b)])
  nodes = TV.node_tokens(tree, jnp.asarray(cands, jnp.int32))
  targets = rng.integers(0, 3, (b, tree.size + 1))
  one_hot = jax.nn.one_hot(jnp.asarray(targets), v)
  logp = jnp.where(one_hot > 0, 0.0, sampling.NEG_INF)
  logq = jnp.log(jnp.full((b, tree.size + 1, v), 1.0 / v))
  want = jax.jit(TV.verify_greedy, static_argnums=0)(tree, nodes, one_hot)
  verify = jax.jit(TV.verify_sampling, static_argnums=1, static_argnames="mode")
  got = verify(jax.random.key(0), tree, nodes, logp, logq, mode=mode)
  assert got.accepted_B.tolist() == want.accepted_B.tolist()
  assert (want.accepted_B > 0).any()
  assert got.path_BD.tolist() == want.path_BD.tolist()
  assert got.tokens_BD.tolist() == want.tokens_BD.tolist()


# ---------------------------------------------------------------- sampling is lossless


def _language(v, depth, seed):
  """A toy trunk: the next token's distribution for every prefix, tables P[d] of d+1 axes."""
  rng = np.random.default_rng(seed)
  return [rng.dirichlet(np.full(v, 0.6), size=(v,) * d) for d in range(depth + 1)]


def _heads(lm, seed):
  """[3, V] toy parallel heads: half the trunk's distribution along its likeliest path, half
  noise, so that several ranks and depths get accepted."""
  noise = np.random.default_rng(seed).dirichlet(np.full(lm[0].shape[-1], 0.6), size=3)
  a = np.argmax(lm[0])
  b = np.argmax(lm[1][a])
  return 0.5 * np.stack([lm[0], lm[1][a], lm[2][a, b]]) + 0.5 * noise


def _trunk_logp(tree, lm, nodes_BT):
  """[B, T+1, V]: the toy trunk's log p at the root and at every node (given its path)."""
  cols = [np.broadcast_to(lm[0], (nodes_BT.shape[0], lm[0].shape[-1]))]
  for i in range(tree.size):
    path = tree.paths_TD[i][tree.paths_TD[i] >= 0]
    cols.append(lm[len(path)][tuple(nodes_BT[:, j] for j in path)])
  return np.log(np.maximum(np.stack(cols, 1), 1e-30)).astype(np.float32)


def _tree_step(tree, lm, q_KV, n_rows, mode, seed, verify_mode=None):
  """One verify step of n_rows rows; -> (first two emitted tokens [n, 2], verdict). Where the
  step emits one token, the second is the next step's, sampled from the trunk directly."""
  k_draw, k_verify = jax.random.split(jax.random.key(seed))
  logq_BKV = jnp.broadcast_to(jnp.log(jnp.asarray(q_KV, jnp.float32)), (n_rows,) + q_KV.shape)
  if mode == "sampled":
    cands = TV.draw_candidates(k_draw, logq_BKV, tree.top_k)
  else:
    cands = TV.topk_candidates(logq_BKV, tree.top_k)
  nodes = np.asarray(TV.node_tokens(tree, cands))
  logp = _trunk_logp(tree, lm, nodes)
  verify = jax.jit(TV.verify_sampling, static_argnums=(1,), static_argnames="mode")
  out = verify(k_verify, tree, jnp.asarray(nodes), jnp.asarray(logp),
               logq_BKV, TV.head_rows(tree, q_KV.shape[0]), mode=verify_mode or mode)
  return _first_two(lm, out, seed), out


def _first_two(lm, out, seed):
  tokens, n = np.asarray(out.tokens_BD), np.asarray(out.accepted_B)
  rng = np.random.default_rng(seed)
  second = [rng.choice(lm[0].shape[-1], p=lm[1][a]) for a in tokens[n == 0, 0]]
  pair = tokens[:, :2].copy()
  pair[n == 0, 1] = second
  return pair


def _per_parent_step(tree, lm, n_rows, mode, seed):
  """As _tree_step with a drafter whose q depends on the node's path (EAGLE-like): half the
  trunk's distribution there, half noise; each parent's children are its q's best tokens
  ('topk') or drawn from it without replacement ('sampled')."""
  rng = np.random.default_rng(seed)
  v = lm[0].shape[-1]
  noise = rng.dirichlet(np.full(v, 0.6), size=tree.size + 1)
  nodes = np.zeros((n_rows, tree.size), np.int64)
  logq = np.zeros((n_rows, tree.size + 1, v), np.float32)
  for pos in range(tree.size + 1):                   # parents come before their children
    path = [] if pos == 0 else list(tree.paths_TD[pos - 1][tree.paths_TD[pos - 1] >= 0])
    q = 0.5 * lm[len(path)][tuple(nodes[:, j] for j in path)] + 0.5 * noise[pos]
    logq[:, pos] = np.log(q)
    keys = logq[:, pos] + (rng.gumbel(size=(n_rows, v)) if mode == "sampled" else 0.0)
    order = np.argsort(-keys, axis=-1)
    kids = tree.children_PR[pos]
    for r, child in enumerate(kids[kids >= 0]):
      nodes[:, child] = order[:, r]
  logp = _trunk_logp(tree, lm, nodes)
  verify = jax.jit(TV.verify_sampling, static_argnums=(1,), static_argnames="mode")
  out = verify(jax.random.key(seed), tree, jnp.asarray(nodes, jnp.int32), jnp.asarray(logp),
               jnp.asarray(logq), mode=mode)
  return _first_two(lm, out, seed), out


def _goodness_of_fit(samples, probs):
  """Chi-square p-value of samples (flat category indices) against exact probabilities;
  categories expecting fewer than 20 samples are pooled."""
  counts = np.bincount(samples, minlength=probs.size).astype(float)
  expected = probs.ravel() * len(samples)
  small = expected < 20
  obs = np.r_[counts[~small], counts[small].sum()]
  exp = np.r_[expected[~small], expected[small].sum()]
  assert counts[probs.ravel() == 0].sum() == 0, "a token the trunk gives no mass was emitted"
  return sstats.chisquare(obs[exp > 0], exp[exp > 0]).pvalue


@pytest.mark.parametrize("mode", TV.MODES)
def test_sampling_is_lossless(mode):
  """The first emitted token and the first two follow plain sampling from the trunk, with
  several children tried at one depth and paths to depth 3. Fails below p = 1e-4."""
  v, n_rows, tree = 6, 120_000, _tree()
  lm = _language(v, tree.max_depth, seed=3)
  pair, out = _tree_step(tree, lm, _heads(lm, 4), n_rows, mode, seed=5)
  n, path = np.asarray(out.accepted_B), np.asarray(out.path_BD)
  # The rule was exercised: later siblings accepted after rejections at every depth, whole
  # paths, and no draft at all.
  assert np.mean(path[:, 0] == 1) > 0.01 and np.mean(path[:, 0] == 2) > 0.003
  assert np.mean(path[:, 1] == 4) > 0.01 and np.mean(path[:, 2] == 7) > 0.001
  assert np.mean(n == 3) > 0.005 and np.mean(n == 0) > 0.01
  joint = lm[0][:, None] * lm[1]
  assert _goodness_of_fit(pair[:, 0], lm[0]) > 1e-4
  assert _goodness_of_fit(pair[:, 0] * v + pair[:, 1], joint) > 1e-4


@pytest.mark.parametrize("mode", TV.MODES)
def test_sampling_is_lossless_with_a_draft_per_parent(mode):
  """The same with drafts that depend on their parent's path (q given per input position)."""
  v, n_rows, tree = 6, 120_000, _tree()
  lm = _language(v, tree.max_depth, seed=3)
  pair, out = _per_parent_step(tree, lm, n_rows, mode, seed=7)
  n, path = np.asarray(out.accepted_B), np.asarray(out.path_BD)
  assert np.mean(path[:, 0] == 1) > 0.01 and np.mean(path[:, 1] == 4) > 0.01
  assert np.mean(n == 3) > 0.005 and np.mean(n == 0) > 0.01
  assert _goodness_of_fit(pair[:, 0], lm[0]) > 1e-4
  assert _goodness_of_fit(pair[:, 0] * v + pair[:, 1], lm[0][:, None] * lm[1]) > 1e-4


def test_the_lossless_check_catches_a_wrong_q():
  """The same check fails for the rule that is not lossless: top-k drafts verified as if they
  had been drawn from the head's q (min(1, p/q) with the head's probabilities)."""
  v, n_rows, tree = 6, 120_000, _tree()
  lm = _language(v, tree.max_depth, seed=3)
  pair, _ = _tree_step(tree, lm, _heads(lm, 4), n_rows, "topk", seed=5, verify_mode="sampled")
  joint = lm[0][:, None] * lm[1]
  assert _goodness_of_fit(pair[:, 0] * v + pair[:, 1], joint) < 1e-6


# ---------------------------------------------------------------- trees from rates


def test_build_tree_by_hand():
  rates = [[0.6, 0.2], [0.5, 0.1]]
  # values: (0,) .6, (0,0) .3, (1,) .2, (1,0) .1, (0,1) .06, (1,1) .02
  assert S.build_tree(rates, 3).choices == ((0,), (1,), (0, 0))
  assert S.build_tree(rates, 4).choices == ((0,), (1,), (0, 0), (1, 0))
  assert S.build_tree(rates, 100).size == 6                 # every node the rates allow
  assert S.expected_accepted(S.build_tree(rates, 3), rates) == pytest.approx(1.1)
  assert S.expected_accepted(S.build_tree(rates, 4), rates) == pytest.approx(1.2)


def test_build_tree_respects_the_budget_and_is_prefix_closed():
  rng = np.random.default_rng(0)
  for trial in range(20):
    k, r = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    rates = [sorted(rng.dirichlet(np.ones(r + 1))[:r], reverse=True) for _ in range(k)]
    best = 0.0
    for budget in (1, 2, 4, 8, 16, 32):
      tree = S.build_tree(rates, budget)       # Tree() itself checks prefixes and siblings
      assert tree.size == min(budget, sum(r ** d for d in range(1, k + 1)))
      assert tree.max_depth <= k and tree.top_k <= r
      got = S.expected_accepted(tree, rates)
      assert got >= best - 1e-12
      best = got
      chain = S.Chain(min(budget, k)).as_tree()  # greedy beats the chain of the same size
      if chain.size == tree.size:
        assert got >= S.expected_accepted(chain, rates) - 1e-12


def test_default_trees():
  for budget in S.DEFAULT_BUDGETS:
    tree = S.default_tree(budget, num_heads=3)
    assert tree.size == budget and tree.max_depth <= 3 and tree.top_k <= S.DEFAULT_TOP_K
    assert tree.choices[0] == (0,)
  assert S.default_tree(4, 1).choices == ((0,), (1,), (2,), (3,))


def test_rates_are_checked():
  for bad, message in [([], "non-empty"), ([[0.5, 0.7]], "summing"), ([[1.2]], "rates[0]"),
                       ([[0.5], []], "rates[1]")]:
    with pytest.raises(S.ShapeError, match=message.replace("[", r"\[").replace("]", r"\]")):
      S.build_tree(bad, 4)


def test_trees_file_round_trip_and_errors(tmp_path):
  path = str(tmp_path / S.TREES_FILE)
  rates = [[0.6, 0.2], [0.5, 0.1]]
  S.save_trees(path, rates, {4: S.build_tree(rates, 4), 2: S.Chain(2).as_tree()})
  got_rates, trees = S.load_trees(path)
  assert got_rates == ((0.6, 0.2), (0.5, 0.1))
  assert trees == {4: S.build_tree(rates, 4), 2: S.Chain(2).as_tree()}
  # tree_for: the stored tree, else built from stored rates, else the default.
  assert S.tree_for(2, 2, str(tmp_path)) == S.Chain(2).as_tree()
  assert S.tree_for(3, 2, str(tmp_path)) == S.build_tree(rates, 3)
  assert S.tree_for(8, 3, str(tmp_path / "none")) == S.default_tree(8, 3)
  with pytest.raises(S.ShapeError, match="depth 2 is beyond the 1 heads"):
    S.tree_for(2, 1, str(tmp_path))
  for doc, message in [("{", "not valid JSON"), ('{"format": "x"}', "not a trees file"),
                       (json.dumps({"format": S.TREES_FORMAT, "version": 2}), "version 2"),
                       (json.dumps({"format": S.TREES_FORMAT, "version": 1,
                                    "trees": {"4": [[0], [0, 1]]}}),
                        "tree path (0, 1): rank 1 needs its elder sibling (0, 0)"),
                       (json.dumps({"format": S.TREES_FORMAT, "version": 1,
                                    "trees": {"1": [[0], [1]]}}), "2 nodes exceed the budget"),
                       (json.dumps({"format": S.TREES_FORMAT, "version": 1,
                                    "rates": [[2.0]]}), "rates[0]")]:
    with open(path, "w") as f:
      f.write(doc)
    with pytest.raises(S.ShapeError) as e:
      S.load_trees(path)
    assert path in str(e.value) and message in str(e.value)
  with pytest.raises(S.ShapeError, match="cannot read"):
    S.load_trees(str(tmp_path / "missing.json"))


def test_topk_hits_by_hand():
  logits = jnp.array([[[[5., 4, 3, 2, 1], [1, 5, 2, 0, 0]],       # t0: ranks 1, 0
                       [[5., 4, 3, 2, 1], [5, 4, 3, 2, 1]]]])     # t1: ranks 3, 2
  targets = jnp.array([[[1, 1], [3, 2]]])
  valid = jnp.ones((1, 2, 2), bool)
  hits, trials = S.topk_hits(logits, targets, valid, top_k=3, conditional=False)
  assert hits.tolist() == [[0, 1, 0], [1, 0, 1]] and trials.tolist() == [2, 2]
  hits, trials = S.topk_hits(logits, targets, valid, top_k=3, conditional=True)
  assert hits.tolist() == [[0, 1, 0], [1, 0, 0]] and trials.tolist() == [2, 1]
  assert S.rates_from_hits(hits, trials) == ((0.0, 0.5, 0.0), (1.0, 0.0, 0.0))


# ---------------------------------------------------------------- committing the path


def test_commit_path_moves_the_accepted_entries():
  b, s, g, h = 3, 20, 2, 4
  buf = jnp.asarray(np.random.default_rng(0).normal(size=(b, s, g, h)), jnp.float32)
  scale = jnp.asarray(np.random.default_rng(1).normal(size=(b, s, g)), jnp.float32)
  length = jnp.array([3, 5, 9])
  path = jnp.array([[0, 3, 7], [1, 5, -1], [-1, -1, -1]])
  n = jnp.array([3, 2, 0])
  commit = jax.jit(TV.commit_path, donate_argnums=0)
  got = np.asarray(commit(jnp.array(buf), length, path, n))
  want = np.array(buf)
  for row in range(b):
    for d in range(int(n[row])):
      want[row, int(length[row]) + d] = buf[row, int(length[row]) + int(path[row, d])]
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(want[0, 4], np.asarray(buf)[0, 4])   # entries really moved
  cache = {"k": (buf,), "k_scale": (scale,)}
  moved = TV.commit_path_cache(cache, length, path, n)
  np.testing.assert_array_equal(moved["k"][0], want)
  assert moved["k_scale"][0][0, 4].tolist() == scale[0, 6].tolist()


def test_step_presence_counts_the_history_and_the_node_path():
  tree, v = _tree(), 12
  base = jnp.zeros((1, v), bool).at[0, 11].set(True)
  nodes = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]])
  pres = np.asarray(TV.step_presence(tree, base, nodes))[0]
  on = lambda pos: np.flatnonzero(pres[pos]).tolist()
  assert on(0) == [11] and on(1) == [1, 11] and on(6) == [2, 6, 11]
  assert on(8) == [1, 4, 8, 11]                        # (0,0,1): nodes 0, 3, 7


def test_step_inputs():
  tree = _tree()
  tokens, positions = TV.step_inputs(tree, jnp.array([7, 8]), jnp.zeros((2, 8), jnp.int32),
                                     jnp.array([10, 4]))
  assert tokens[:, 0].tolist() == [7, 8]
  assert positions[0].tolist() == [9, 10, 10, 10, 11, 11, 11, 12, 12]
  assert positions[1, 0] == 3
