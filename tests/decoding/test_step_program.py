"""The compiled decode loop: what XLA makes of the step.

A decode step is bound by reading the weights once; a weight copied inside the loop is read and
written again every step. XLA:CPU transposes a weight whose contraction does not match the layout
it picked for the activations: an einsum over two of the weight's dims (the attention's output
projection over heads and head dim), or over a stack of weights the activations do not share
(all parallel heads at once)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import DecodeConfig, HeadsConfig
from mtp_jax.decoding import engine as E
from mtp_jax.decoding import shapes
from mtp_jax.models import model as model_lib
from tests.conftest import tiny_config


def weight_copies(hlo: str, weights) -> list[str]:
  """The copy instructions in `hlo` whose shape is a permutation of a weight's (2-D or more)."""
  weight_shapes = {tuple(sorted(x.shape)) for x in jax.tree.leaves(weights) if x.ndim >= 2}
  out = []
  for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", hlo):
    shape = tuple(sorted(int(d) for d in dims.split(",") if d))
    if shape in weight_shapes and math.prod(shape) >= 1024:
      out.append(dims)
  return out


def test_the_check_sees_a_weight_copied_in_a_loop():
  """The kind of contraction the output projection had: activations laid out [B, T, H, N]
  against a weight [N, H, D], in a loop. XLA:CPU copies the weight every iteration, and
  weight_copies finds it (else the test below proves nothing)."""
  w_in, w = jnp.ones((64, 64)), jnp.ones((4, 16, 64))          # [D, H*N], [N, H, D]

  def loop(x_BTD, w_in, w_NHD):
    def body(_, x):
      y_BTHN = (x @ w_in).reshape(x.shape[0], x.shape[1], 16, 4)
      return jnp.einsum("BTHN,NHD->BTD", y_BTHN, w_NHD) + x
    return jax.lax.fori_loop(0, 3, body, x_BTD)
  hlo = jax.jit(loop).lower(jnp.ones((2, 1, 64)), w_in, w).compile().as_text()
  assert weight_copies(hlo, [w]) != []


@pytest.mark.parametrize("kind, tree, sample", [("parallel", False, False),
                                                ("sequential", False, False),
                                                ("parallel", True, True)])
def test_no_weight_is_copied_in_the_step(kind, tree, sample):
  """Every weight of the trunk and the heads is read in place by the compiled decode loop:
  chains greedy, a token tree sampled."""
  cfg = tiny_config()
  hcfg = HeadsConfig(kind=kind, num=2)
  _, params = model_lib.split(model_lib.create(cfg.model, hcfg, seed=0))
  shape = {"tree": shapes.tree_for(4, 2).choices} if tree else {}
  eng = E.Engine(cfg.model, hcfg, DecodeConfig(batch_size=2, k=2, ring_size=8, **shape), 0)
  hlo = eng._generate.lower(params, eng.unembed(params), eng.init_state(), np.int32(4),
                            np.int32(0), np.float32(np.inf), np.bool_(False), sample=sample,
                            ks=eng.ks).compile().as_text()
  assert weight_copies(hlo, params) == []
