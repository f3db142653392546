"""`mtp-bench`'s modes: the grammar, in one place and free of JAX (the CLI checks its flags with
it before JAX is imported)."""

from __future__ import annotations

_COUNTED = {"mtp": "heads", "draft": "model", "ngram": "ngram"}


def parse_mode(mode: str) -> tuple[str, int | str]:
  """'vanilla' and 'control' -> ('heads', 0), 'mtp:K' -> ('heads', K), 'adaptive' -> ('heads',
  'auto'), 'draft:K' -> ('model', K), 'ngram:K' -> ('ngram', K), 'tree:T' -> ('heads', 'tree:T')
  (K, T >= 1). Anything else raises ValueError naming the mode."""
  if mode in ("vanilla", "control"):
    return "heads", 0
  if mode == "adaptive":
    return "heads", "auto"
  kind, _, n = mode.partition(":")
  if n.isascii() and n.isdigit() and int(n) > 0:     # int() would take other digits too
    if kind == "tree":
      return "heads", f"tree:{int(n)}"
    if kind in _COUNTED:
      return _COUNTED[kind], int(n)
  raise ValueError(f"unknown mode {mode!r} (expected vanilla, control, adaptive, mtp:K, "
                   "draft:K, ngram:K or tree:T with K, T >= 1)")
