"""Plain greedy decoding with the KV cache: one token per step, no drafts.

The reference that speculative decoding must reproduce token for token, and the generator of
the trunk's own continuations for heads_only self-distillation. Rows may have different prompt
lengths: the prompt buffer is right-padded and each row decodes from its own length (pad
positions are overwritten before they are attended to).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtp_jax.models import cache as kv
from mtp_jax.models import model as model_lib


@functools.partial(jax.jit, static_argnames=("graphdef", "num_new", "pad_id"))
def greedy_generate(graphdef, params, prompt_BP, lengths_B, num_new: int, pad_id: int = 0):
  """-> tokens [B, P + num_new]: row b holds its prompt, then num_new greedy tokens from
  position lengths_B[b] on (positions past lengths_B[b] + num_new keep their padding: the
  prompt's own, then pad_id)."""
  m = model_lib.bind(graphdef, params)
  b, p = prompt_BP.shape
  total = p + num_new
  buf_BS = jnp.pad(prompt_BP, ((0, 0), (0, num_new)), constant_values=pad_id)
  cache = kv.init_cache(m.cfg, b, total, model_lib.compute_dtype(m.cfg))
  # Prefill the padded prompt; the loop then re-feeds each row's last prompt token at its own
  # position (rewriting that K/V identically) and pad positions are overwritten before use.
  _, cache = m(prompt_BP, jnp.broadcast_to(jnp.arange(p), (b, p)), cache)

  def step(i, carry):
    buf_BS, cache = carry
    pos_B = lengths_B - 1 + i
    tok_B = jnp.take_along_axis(buf_BS, pos_B[:, None], axis=1)
    h, cache = m(tok_B, pos_B[:, None], cache)
    nxt_B = jnp.argmax(m.logits(h[:, 0]), axis=-1).astype(buf_BS.dtype)
    buf_BS = buf_BS.at[jnp.arange(b), pos_B + 1].set(nxt_B)
    return buf_BS, cache

  buf_BS, _ = jax.lax.fori_loop(0, num_new, step, (buf_BS, cache))
  return buf_BS

