"""Plain greedy decoding with the KV cache: one token per step, no drafts.

The reference that speculative decoding must reproduce token for token, the generator of the
trunk's own continuations for heads_only self-distillation, and what `make demo` runs until the
batch job exists. Rows may have different prompt lengths: the prompt buffer is right-padded and
each row decodes from its own length (pad positions are overwritten before they are attended to).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtp_jax import cache as kv
from mtp_jax import model as model_lib


@functools.partial(jax.jit, static_argnames=("graphdef", "num_new"))
def greedy_generate(graphdef, params, prompt_BP, lengths_B, num_new: int):
  """-> tokens [B, P + num_new]: row b holds its prompt, then num_new greedy tokens from
  position lengths_B[b] on (positions past lengths_B[b] + num_new keep their padding)."""
  m = model_lib.bind(graphdef, params)
  b, p = prompt_BP.shape
  total = p + num_new
  buf_BS = jnp.pad(prompt_BP, ((0, 0), (0, num_new)))
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


def bucket_length(n: int, max_len: int, smallest: int = 16) -> int:
  """The smallest power-of-two bucket (>= smallest) holding n tokens, capped at max_len."""
  b = smallest
  while b < n:
    b *= 2
  return min(b, max_len)


def complete(graphdef, params, tokenizer, prompts: list[str], max_new_tokens: int,
             max_len: int) -> list[dict]:
  """Greedy completions of text prompts: -> [{'text', 'token_ids', 'finish_reason'}].

  Prompts are padded to a length bucket (one compile per bucket and batch size); a completion
  ends at the end-of-document token or after max_new_tokens.
  """
  ids = [tokenizer.encode(p) or [tokenizer.eod_id] for p in prompts]
  longest = max(len(x) for x in ids)
  if longest + max_new_tokens > max_len:
    raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the "
                     f"model's context of {max_len}")
  p = bucket_length(longest, max_len - max_new_tokens)
  prompt = jnp.full((len(ids), p), tokenizer.pad_id, jnp.int32)
  for b, x in enumerate(ids):
    prompt = prompt.at[b, : len(x)].set(jnp.asarray(x, jnp.int32))
  lengths = jnp.asarray([len(x) for x in ids], jnp.int32)
  out = jax.device_get(greedy_generate(graphdef, params, prompt, lengths, max_new_tokens))
  results = []
  for b, x in enumerate(ids):
    new = [int(t) for t in out[b, len(x): len(x) + max_new_tokens]]
    reason = "length"
    if tokenizer.eod_id in new:
      new, reason = new[: new.index(tokenizer.eod_id)], "stop"
    results.append({"text": tokenizer.decode(new), "token_ids": new, "finish_reason": reason})
  return results
