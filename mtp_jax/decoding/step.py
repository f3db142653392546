"""One draft-and-verify step for every row at once, for any drafter and draft shape.

  1. input: [last committed token, d_1..d_k] at positions length-1 .. length-1+k;
  2. trunk: runs the k+1 tokens, writing their K/V into the cache at those positions;
  3. verify: keeps the longest acceptable draft prefix and adds one token from the trunk;
  4. commit: writes the accepted tokens, advances the length (rollback is the length alone);
  5. draft: the drafter (drafters/) proposes the next drafts from what the step hands it;
  6. record: one ring entry (the adaptive controller reads its window) and the run's counters.
Rejected drafts leave K/V past the committed length: masked, and overwritten later.
The draft shape is static: a chain (shapes.Chain) or a token tree (shapes.Tree), whose steps 1-3
are `_tree_pass` (tree_verify.py): the root and T nodes in one pass under the ancestor mask, the
longest accepted path, and its K/V moved from the tree slots to the positions it was accepted at.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.decoding import ring as ring_lib
from mtp_jax.decoding import sampling, shape_set, tree_verify
from mtp_jax.decoding.drafters.base import DraftInput, no_drafts
from mtp_jax.decoding.shapes import Chain, Tree
from mtp_jax.decoding.state import Caches, DecodeState, Drafts, Record


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The static facts a step reads (hashable: part of the compiled program)."""
  kd: int                   # drafts kept in the state (K_max)
  end_ids: tuple[int, ...]  # the tokens that end a row (end of document, end of turn)
  vocab_size: int
  conf_threshold: float     # > 0: a row verifies its drafts before the first doubtful one
  adaptive: bool            # an adaptive engine: rows verify only fresh drafts; a controller


def row_limit(sc: StepConfig, drafts: Drafts):
  """Per row, the drafts it may verify: its fresh drafts, cut before the first one whose
  confidence is below the threshold."""
  if sc.conf_threshold <= 0 or sc.kd == 0:
    return drafts.n_fresh
  low = drafts.conf < sc.conf_threshold
  cut = jnp.where(jnp.any(low, 1), jnp.argmax(low, 1), sc.kd).astype(jnp.int32)
  return jnp.minimum(cut, drafts.n_fresh)


def step(sc: StepConfig, drafter, m, dm, state: DecodeState, shape: Chain | Tree, sample: bool,
         n_draft: int | None = None, want_conf: bool = True, ranked: bool = True,
         index: int | None = None) -> DecodeState:
  """One step verifying `shape` (static), then drafting n_draft (default Kd) for the next one.

  The adaptive loop drafts only what the next step of the same k may verify (none in a plain
  segment, so that choosing k = 0 costs what plain decoding costs; one head in the last two
  steps of a probe segment); the drafts not made keep their old values with zero confidence and
  are not fresh. want_conf: the controller reads this step's draft confidences
  (DraftSpec.conf_cols). m, dm: the bound target and draft models (dm None but for a draft model).
  A tree's k is its depth: the drafts a step may accept. ranked: where the drafts hold each
  head's top candidates ([B, Kd, R]: trees), draft them all (else the best alone, at rank 0).
  index: what the ring records as the step's k_used (adaptive k: the shape's index; default k).
  """
  tree = shape if isinstance(shape, Tree) else None
  k = shape.k if tree is None else tree.max_depth
  nd = sc.kd if n_draft is None else n_draft
  rows = state.rows
  length, active = rows.length, ~rows.done
  keys = sampling.split_rows(state.sampling.key, 3)                    # per-row streams
  key, k_verify, k_draft = keys[:, 0], keys[:, 1], keys[:, 2]
  sp = state.sampling.processors
  # 1. input
  last = jnp.take_along_axis(rows.tokens, (length - 1)[:, None], axis=1)
  k_row = jnp.minimum(row_limit(sc, state.drafts), k)
  last_B = None       # a tree: the input of the last accepted token (a chain's is n)
  head_logits = None   # the heads' logits at every verified position (_logits)
  if tree is None:
    drafts_BK = chain_tokens(state.drafts.tokens)[:, :k]
    inp_BT = jnp.concatenate([last, drafts_BK], axis=1)                 # [B, k+1]
    pos_BT = (length - 1)[:, None] + jnp.arange(k + 1)[None]
    # 2. trunk
    h_BTD, trunk = m(inp_BT, pos_BT, state.caches.trunk)
    logits_BTV, head_logits = _logits(sc, drafter, m, h_BTD, nd)
    # 3. verify
    n, out_BT, base_BV, logp_BTV = _verify(sc, state, drafts_BK, logits_BTV, k_row, k_verify,
                                           sp, sample)
  else:                                   # 1-3, and the accepted path's K/V put in place
    limit_B = k_row if sc.adaptive else None      # an adaptive row's fresh drafts
    n, out_BT, base_BV, last_B, h_BTD, trunk, path_BD = _tree_pass(
        sc, m, state, tree, last[:, 0], k_verify, sp, sample, limit_B)
  # 4. commit
  rows, n_emit = _commit(sc, rows, n, out_BT, k)
  presence = None
  if sample:   # the history grows by the emitted tokens only: no second scan of the buffer
    emitted = jnp.arange(k + 1)[None] < n_emit[:, None]
    presence = base_BV.at[jnp.arange(length.shape[0])[:, None], out_BT].max(emitted)
  # 5. draft
  inp = DraftInput(h_BTD=h_BTD, n_B=n, tokens_BS=rows.tokens, start_B=length,
                   length_B=rows.length, active_B=active, k=k, draft_cache=state.caches.draft,
                   seq_h=state.caches.seq_h, key=k_draft, sp=sp, presence_BV=presence,
                   last_B=last_B, head_logits_BTNV=head_logits)
  drafts, dcache, seq_h = _draft_next(sc, drafter, m, dm, inp, state.drafts, nd, sample,
                                      want_conf, ranked)
  # 6. record
  checked = sc.adaptive and k == 0 and sc.kd > 0   # a probe's draft, against plain decoding
  n_rec, k_rec = (_shadow_check(sc, state, out_BT, logp_BTV, k_verify, sample) if checked
                  else (n, k_row))
  if tree is not None and sc.adaptive:   # what the tree's rank-0 chain accepted (shape_set.py)
    n_rec, k_rec = tree_verify.chain_accepted(tree, path_BD), jnp.minimum(
        k_row, shape_set.chain_depth(tree))
  record, reached_BK, hit_BK = _record(sc, state, n_rec, n_emit, out_BT, k_rec,
                                       k if index is None else index,
                                       verified_by_trunk=not checked)
  rows = rows.replace(steps=rows.steps + active.astype(jnp.int32),
                      emitted=rows.emitted + n_emit)
  if sc.adaptive:
    rows = rows.replace(cond_trials=rows.cond_trials + reached_BK.astype(jnp.int32),
                        cond_hits=rows.cond_hits + hit_BK.astype(jnp.int32))
  return DecodeState(rows=rows, drafts=drafts,
                     caches=Caches(trunk=trunk, draft=dcache, seq_h=seq_h),
                     sampling=state.sampling.replace(key=key), record=record,
                     controller=state.controller)


# The most rows of one unembedding product that a step unembeds the heads in (_logits).
ONE_PASS_ROWS = 16


def _logits(sc: StepConfig, drafter, m, h_BTD, nd: int):
  """-> (the trunk's logits [B, T, V], the first nd heads' logits at every position [B, T, nd, V]
  or None). Where the drafter's heads read the trunk's hidden state alone (parallel heads) and
  the product stays small, the heads run at all T verified positions and are unembedded in the
  trunk's product: one pass over the [D, V] unembedding a step instead of two (the heads'
  hidden states at the accepted position, unembedded after verification). A memory-bound step
  reads the unembedding once; past ONE_PASS_ROWS rows the product's arithmetic, T times the
  heads', outweighs the pass it saves (docs/benchmarks.md, Real shapes)."""
  b, t, _ = h_BTD.shape
  shared = not m.heads_cfg.own_unembed       # heads with their own unembedding read their own
  if not (nd and shared and getattr(drafter, "one_pass", False)
          and b * t * (1 + nd) <= ONE_PASS_ROWS):
    return m.logits(h_BTD), None
  x = jnp.concatenate([h_BTD[:, :, None], m.head_hidden(h_BTD, n=nd)], axis=2)
  logits = m.logits(x)                                               # [B, T, 1 + nd, V]
  return logits[:, :, 0], logits[:, :, 1:]


def _verify(sc, state, drafts_BK, logits_BTV, k_row, k_verify, sp, sample: bool):
  """-> (accepted n [B], emitted tokens [B, k+1], the history's presence [B, V] and the processed
  target log-probabilities [B, k+1, V] when sampling).
  Rows verify only their fresh drafts (n_fresh, and the threshold's cut): a stale draft was
  proposed for another position. A fixed engine without a threshold has all k fresh in every
  row (k_row == k), so it skips the masks."""
  cut = k_row if sc.conf_threshold > 0 or sc.adaptive else None
  if not sample:
    return sampling.verify_greedy(drafts_BK, logits_BTV, cut) + (None, None)
  # Position j is verified against the history plus drafts 1..j.
  k, v = drafts_BK.shape[1], sc.vocab_size
  base = sampling.presence(state.rows.tokens, state.rows.length, v)
  seen = jnp.cumsum(jax.nn.one_hot(drafts_BK, v, dtype=jnp.int32), axis=1) > 0   # [B, k, V]
  pres = jnp.concatenate([base[:, None], base[:, None] | seen], axis=1)        # [B, k+1, V]
  logp = sampling.process_logits(logits_BTV, *sp, pres)
  n, out = sampling.verify_sampling(k_verify, drafts_BK, state.drafts.logq[:, :k], logp, cut)
  return n, out, base, logp


def _shadow_check(sc, state, out_BT, logp_BTV, key, sample: bool):
  """A plain step of the adaptive loop holding a fresh first draft (a probe's: loop.py) checks
  it as a step of one draft would have verified it, and commits nothing of it: accepted where it
  equals the token plain decoding chose (greedy), or with probability min(1, p/q) at it
  (sampling: a coin of its own, apart from the token's). So a probe costs the heads' work alone:
  no step of two tokens, and rows that accept stay in step with rows that do not. A row's first
  step checks nothing: its draft is the prefill's, of the token after the prompt's first new one,
  far harder to guess than text further on (a job decoding plainly that counted those alone
  measured 0.29 where probes measure ~0.65, and stored it as the next process's prior).
  -> (accepted [B], verified [B]) for the record."""
  fresh = (row_limit(sc, state.drafts) > 0) & ~state.rows.done & (state.rows.steps > 0)
  d_B = chain_tokens(state.drafts.tokens)[:, 0]
  if not sample:
    hit = d_B == out_BT[:, 0]
  else:
    take = lambda x_BV: jnp.take_along_axis(x_BV, d_B[:, None], 1)[:, 0]
    u = jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 1)))(key)
    hit = jnp.log(u) < take(logp_BTV[:, 0]) - take(state.drafts.logq[:, 0])
  return (fresh & hit).astype(jnp.int32), fresh.astype(jnp.int32)


def chain_tokens(tokens):
  """The chain's drafts [B, Kd]: rank 0 of drafts that hold each head's candidates [B, Kd, R]."""
  return tokens[..., 0] if tokens.ndim == 3 else tokens


def _tree_pass(sc, m, state, tree: Tree, last_B, k_verify, sp, sample: bool, limit_B=None):
  """Steps 1-3 for a tree: inputs [root, T nodes] at positions length-1+depth, one trunk pass
  under the ancestor mask (K/V to the tree slots length-1 .. length-1+T), verification, and the
  accepted path's K/V moved to length .. length+n-1 (the length before the step: the nodes'
  slots are counted from it). Greedy rows of a sampled step reduce to the greedy rule.
  -> (n [B], emitted tokens [B, D+1], the history's presence [B, V] when sampling, the input
  of the last accepted token [B], h [B, T+1, D], the trunk's cache, the accepted path [B, D]).
  limit_B: per row, the depth past which no node may be accepted (its fresh drafts)."""
  rows = state.rows
  nodes_BT = tree_verify.node_tokens(tree, state.drafts.tokens)
  inp_BP, pos_BP = tree_verify.step_inputs(tree, last_B, nodes_BT, rows.length)
  h_BPD, trunk = m(inp_BP, pos_BP, state.caches.trunk, query_mask_TT=tree.mask_PP)
  logits_BPV = m.logits(h_BPD)
  base_BV = None
  if sample:
    base_BV = sampling.presence(rows.tokens, rows.length, sc.vocab_size)
    pres_BPV = tree_verify.step_presence(tree, base_BV, nodes_BT)
    logp_BPV = sampling.process_logits(logits_BPV, *sp, pres_BPV)
    verdict = tree_verify.verify_sampling(k_verify, tree, nodes_BT, logp_BPV, state.drafts.logq,
                                          tree_verify.head_rows(tree, sc.kd), mode="sampled",
                                          limit_B=limit_B)
  else:
    verdict = tree_verify.verify_greedy(tree, nodes_BT, logits_BPV, limit_B)
  n = verdict.accepted_B
  trunk = tree_verify.commit_path_cache(trunk, rows.length, verdict.path_BD, n)
  return n, verdict.tokens_BD, base_BV, verdict.last_B, h_BPD, trunk, verdict.path_BD


def _commit(sc, rows, n, out_BT, k: int):
  """Writes each active row's emitted tokens (up to the first end token and its stop
  length) and advances its length. -> (rows, tokens emitted [B])."""
  active, length = ~rows.done, rows.length
  idx = jnp.arange(k + 1)[None]
  eod_at = jnp.min(jnp.where(jnp.isin(out_BT, jnp.asarray(sc.end_ids)), idx, k + 1), axis=1)
  n_emit = jnp.minimum(jnp.minimum(n + 1, eod_at + 1), rows.stop_len - length)
  n_emit = jnp.where(active, n_emit, 0)
  write = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))
  tokens = jnp.where(active[:, None], write(rows.tokens, out_BT, length), rows.tokens)
  new_length = length + n_emit
  done = rows.done | (new_length >= rows.stop_len) | (active & (eod_at < n_emit))
  return rows.replace(tokens=tokens, length=new_length, done=done), n_emit


def _draft_next(sc, drafter, m, dm, inp: DraftInput, old: Drafts, nd: int, sample: bool,
                want_conf: bool, ranked: bool = True):
  """The next drafts (nd of them; none in a plain step). -> (Drafts, draft cache, seq_h)."""
  b = inp.n_B.shape[0]
  dcache, seq_h = inp.draft_cache, inp.seq_h
  if nd:
    new, logq, conf, dcache, seq_h = drafter.draft(m, dm, inp, nd, sample, want_conf, ranked)
  else:
    new, logq, conf = no_drafts(b, sc.vocab_size)
  made = new.shape[1]
  if new.ndim < old.tokens.ndim:     # the best drafts alone: rank 0 (no tree reads the rest)
    new = jnp.concatenate([new[..., None], old.tokens[:, :made, 1:]], 2)
  if not sample:
    # Only sampled verification reads q, and a row that samples runs sampled steps only
    # (greedy rows verify exactly against any q): greedy steps leave logq as it is.
    logq = old.logq
  if made < sc.kd:     # the drafts not made keep their old values, with zero confidence
    new = jnp.concatenate([new, old.tokens[:, made:]], 1)
    if sample:
      logq = jnp.concatenate([logq.astype(jnp.float32), old.logq[:, made:]], 1)
    conf = jnp.concatenate([conf, jnp.zeros_like(old.conf[:, made:])], 1)
  drafts = Drafts(tokens=new, logq=logq, conf=conf, n_fresh=jnp.full_like(old.n_fresh, made))
  return drafts, dcache, seq_h


def _record(sc, state, n, n_emit, out_BT, k_row, k: int, verified_by_trunk: bool = True):
  """The step's ring entry (k: the shape's index, its ring's k_used) and the run's per-position
  counters. -> (Record, per row and draft
  position: reached [B, Kd], accepted there [B, Kd]). A probe's check (not verified_by_trunk)
  goes to the ring and the conditional counts, not to drafted / accepted (drafts the trunk
  verified)."""
  rec, rows = state.record, state.rows
  active = ~rows.done
  n_active = jnp.sum(active.astype(jnp.int32))
  verified = jnp.where(active, k_row, 0)
  pos_k = jnp.arange(sc.kd)[None]
  drafted, accepted = rec.drafted, rec.accepted
  if verified_by_trunk:
    drafted = drafted + jnp.sum((pos_k < verified[:, None]).astype(jnp.int32), 0)
    accepted = accepted + jnp.sum((active[:, None] & (n[:, None] > pos_k)).astype(jnp.int32), 0)
  # Reached: verified there, every draft before it accepted (the conditional counts).
  reached = (pos_k < verified[:, None]) & (n[:, None] >= pos_k)              # [B, Kd]
  hit = reached & (n[:, None] > pos_k)
  ring = ring_lib.record(rec.ring, rec.step, out_BT, n_emit, verified, jnp.where(active, n, 0),
                         k, n_active)
  record = Record(ring=ring, step=rec.step + 1, drafted=drafted, accepted=accepted,
                  cond_trials=rec.cond_trials + jnp.sum(reached.astype(jnp.int32), 0),
                  cond_hits=rec.cond_hits + jnp.sum(hit.astype(jnp.int32), 0))
  return record, reached, hit
