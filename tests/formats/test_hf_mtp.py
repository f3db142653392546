"""Checkpoints that ship MTP layers (MiMo, DeepSeek's layout, Medusa-1 heads), written as published
around tiny transformers trunks: the imported heads' logits equal the layouts' equations written
here in torch, speculative greedy output equals plain, export gives back every tensor bit for bit,
and what cannot be imported is refused in one line naming the tensor or field."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf-test extra (make test installs it)")
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers.models.llama import modeling_llama as llama_lib  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2 as qwen2_lib  # noqa: E402

from mtp_jax.config import DecodeConfig, HeadsConfig  # noqa: E402
from mtp_jax.formats import hf as hf_lib  # noqa: E402
from mtp_jax.formats import hf_mtp  # noqa: E402
from mtp_jax.serving import api  # noqa: E402
from tests.formats.test_hf import BASE, TEXT, _ours, _tokenizer  # noqa: E402

H = BASE["hidden_size"]
KINDS = {  # name: (trunk family, layout, MTP modules or Medusa heads)
    "mimo": ("Qwen2", "mimo", 1),
    "deepseek": ("Llama", "deepseek", 2),
    "medusa": ("Llama", "medusa", 3),
}


def _randn(g, *shape, scale=1.0):
  return torch.randn(*shape, generator=g) * scale


def _module_tensors(cfg, family, prefix, g):
  """A decoder layer (random, from transformers) and the module's norms and projection, under
  the layout's names; the projection keeps most of the hidden state so that drafts get
  accepted."""
  lib = qwen2_lib if family == "Qwen2" else llama_lib
  layer = getattr(lib, f"{family}DecoderLayer")(cfg, layer_idx=0)
  out = {}
  with torch.no_grad():
    for name, p in layer.state_dict().items():
      x = p + _randn(g, *p.shape, scale=0.2) if p.ndim == 1 else p.clone()
      if name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        x = x * 0.3
      out[prefix + name] = x
  return out


def _build(root, name):
  family, layout, n = KINDS[name]
  cfg = getattr(transformers, f"{family}Config")(**BASE, tie_word_embeddings=False)
  cfg._attn_implementation = "eager"
  torch.manual_seed(3)
  model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
  g = torch.Generator().manual_seed(4)
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(_randn(g, *p.shape, scale=0.2))
  path = os.path.join(root, name)
  model.save_pretrained(path, safe_serialization=True)
  _tokenizer(path)
  sd = {k: v.clone() for k, v in model.state_dict().items()}
  eye = torch.eye(H)
  if layout == "medusa":
    medusa = {}
    for i in range(n):
      for j in range(2):
        medusa[f"{i}.{j}.linear.weight"] = _randn(g, H, H, scale=0.05)
        medusa[f"{i}.{j}.linear.bias"] = _randn(g, H, scale=0.05)
      medusa[f"{i}.2.weight"] = sd["lm_head.weight"] + _randn(g, BASE["vocab_size"], H,
                                                              scale=0.01)
    save_file(medusa, os.path.join(path, hf_mtp.MEDUSA_FILE))
    return model, path
  extra = {}
  for i in range(n):
    p = f"model.mtp_layers.{i}." if layout == "mimo" else f"model.layers.{2 + i}."
    norms = hf_mtp._NORMS[layout]
    for norm in norms[:3]:
      extra[p + norm + ".weight"] = 1 + _randn(g, H, scale=0.2)
    hid, emb = eye + _randn(g, H, H, scale=0.05), _randn(g, H, H, scale=0.05)
    extra[p + norms[3] + ".weight"] = torch.cat([hid, emb] if layout == "mimo" else [emb, hid], 1)
    extra.update(_module_tensors(cfg, family, p, g))
    if layout == "deepseek":
      extra[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
      extra[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
  save_file({**sd, **extra}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  hf["num_nextn_predict_layers"] = n
  if layout == "mimo":
    hf.update(architectures=["MiMoForCausalLM"], model_type="mimo")
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  return model, path


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("mtp"))
  models = {name: _build(root, name) for name in KINDS}
  out = {}
  for name, (model, path) in models.items():
    carry = {"deepseek": ["raw", "normed"]}.get(name, [""])
    for c in carry:
      ours = os.path.join(root, f"{name}-{c or 'default'}-ours")
      hf_lib.import_model(path, ours, HeadsConfig(num=2), mtp_carry=c)
      out[name, c] = (model, path, ours)
  return out


def _norm(w, x, eps=BASE["rms_norm_eps"]):
  x = x.double()
  return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()).float()


def _reference_heads(name, model, path, ids, carry):
  """[T, K, V] the heads' logits by the published equations, in torch."""
  family, layout, n = KINDS[name]
  sd = {k: torch.from_numpy(v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
  pre = {}
  hook = model.model.norm.register_forward_hook(lambda mod, inp, out: pre.update(h=inp[0]))
  with torch.no_grad():
    h_normed = model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states[-1][0]
  hook.remove()
  t = len(ids) - 1
  if layout == "medusa":
    heads = {k: torch.from_numpy(v)
             for k, v in load_file(os.path.join(path, hf_mtp.MEDUSA_FILE)).items()}
    out = []
    for i in range(n):
      x = h_normed
      for j in range(2):
        x = x + torch.nn.functional.silu(x @ heads[f"{i}.{j}.linear.weight"].T
                                         + heads[f"{i}.{j}.linear.bias"])
      out.append(x @ heads[f"{i}.2.weight"].T)
    return torch.stack(out, 1).numpy()
  cfg = model.config
  rotary = getattr(qwen2_lib if family == "Qwen2" else llama_lib, f"{family}RotaryEmbedding")(cfg)
  causal = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
  embed = sd["model.embed_tokens.weight"]
  h = pre["h"][0] if layout == "mimo" else h_normed       # MiMo reads the pre-norm state
  out = []
  for i in range(n):
    p = f"model.mtp_layers.{i}." if layout == "mimo" else f"model.layers.{2 + i}."
    en, hn, on, proj = hf_mtp._NORMS[layout]
    tok = torch.tensor(ids[1 + i:] + [0] * i)[:t]
    e = embed[tok].clone()
    if i == 0:
      e[0] = 0                                             # vLLM: no embedding at position 0
    e, hh = _norm(sd[p + en + ".weight"], e), _norm(sd[p + hn + ".weight"], h)
    x = (torch.cat([hh, e], -1) if layout == "mimo" else torch.cat([e, hh], -1)) @ sd[
        p + proj + ".weight"].T
    layer = getattr(qwen2_lib if family == "Qwen2" else llama_lib,
                    f"{family}DecoderLayer")(cfg, layer_idx=0)
    layer.load_state_dict({k[len(p):]: v for k, v in sd.items() if k.startswith(p)
                           and k[len(p):] in layer.state_dict()})
    pos = torch.arange(t)[None] + i
    with torch.no_grad():
      y = layer(x[None], attention_mask=causal, position_ids=pos,
                position_embeddings=rotary(x[None], pos))[0]
    yn = _norm(sd[p + on + ".weight"], y)
    head = sd[p + "shared_head.head.weight"] if layout == "deepseek" else sd["lm_head.weight"]
    out.append(yn @ head.T)
    h = yn if (layout == "mimo" or carry == "normed") else y
  return torch.stack(out, 1).numpy()


CASES = [("mimo", ""), ("deepseek", "raw"), ("deepseek", "normed"), ("medusa", "")]


@pytest.mark.parametrize("name, carry", CASES)
def test_imported_heads_follow_the_published_equations(shipped, name, carry):
  model, path, ours = shipped[name, carry]
  m, mcfg, hcfg, params, tok = _ours(ours)
  n = KINDS[name][2]
  assert hcfg.num == n
  ids = np.random.RandomState(5).randint(2, 300, 33).tolist()
  h, _ = m(jnp.asarray([ids[:-1]]), jnp.arange(32)[None])
  with torch.no_grad():
    np.testing.assert_allclose(np.asarray(m.logits(h))[0],
                               model(torch.tensor([ids[:-1]])).logits[0].numpy(), atol=1e-4)
  got = np.asarray(m.head_logits(h, jnp.asarray([ids])))[0]            # [T, K, V]
  want = _reference_heads(name, model, path, ids, carry)
  for i in range(n):          # module i+1 has targets up to position T-1-i
    np.testing.assert_allclose(got[: 32 - i, i], want[: 32 - i, i], atol=2e-4, err_msg=str(i))


@pytest.mark.parametrize("name, carry, kw", [
    ("mimo", "", dict(k=1)), ("mimo", "", dict(k=3)),           # k=3: module 1 drafts all three
    ("deepseek", "raw", dict(k=2)), ("deepseek", "normed", dict(k=2)),
    ("medusa", "", dict(k=3)), ("medusa", "", dict(tree=((0,), (1,), (0, 0), (0, 0, 0))))])
def test_speculative_greedy_equals_plain(shipped, name, carry, kw):
  _, _, ours = shipped[name, carry]
  _, mcfg, hcfg, params, tok = _ours(ours)
  reqs = [api.Request(tok.encode(p), 40) for p in (TEXT[:30], "class P", "def add(x")]
  plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=0, max_len=128))
  # Random trunks fall into loops of one token, where heads that echo the trunk get accepted.
  loop = np.bincount(sum((c.token_ids for c in plain.run(reqs)), [])).argmax()
  reqs.append(api.Request([int(loop)] * 8, 40))
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, ring_size=8,
                                                         max_len=128, **kw))
  assert [c.token_ids for c in dec.run(reqs)] == [c.token_ids for c in plain.run(reqs)]
  assert sum(dec.last_stats["accepted"]) > 0, "no draft was accepted: the test proves nothing"


@pytest.mark.parametrize("name, carry", CASES[:2] + CASES[3:])
def test_export_gives_back_the_published_tensors(shipped, tmp_path, name, carry):
  _, path, ours = shipped[name, carry]
  exp = str(tmp_path / "exp")
  files = hf_lib.export_model(ours, exp)
  names = ["model.safetensors"] + ([hf_mtp.MEDUSA_FILE] if name == "medusa" else [])
  assert hf_lib.HEADS_FILE not in files
  for fname in names:
    a, b = load_file(os.path.join(path, fname)), load_file(os.path.join(exp, fname))
    assert set(a) == set(b), fname
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  _, note = hf_lib.import_model(exp, str(tmp_path / "again"), HeadsConfig())
  assert note.startswith("Medusa" if name == "medusa" else name), note


def _copy(shipped, tmp_path, name, carry="", config=None, drop=(), reshape=None):
  src = shipped[name, carry][1]
  dst = str(tmp_path / "edited")
  shutil.copytree(src, dst)
  fname = hf_mtp.MEDUSA_FILE if name == "medusa" else "model.safetensors"
  tensors = load_file(os.path.join(dst, fname))
  for k in drop:
    del tensors[k]
  if reshape:
    tensors[reshape] = tensors[reshape][..., : tensors[reshape].shape[-1] // 2]
  from safetensors.numpy import save_file as save_np
  save_np(tensors, os.path.join(dst, fname))
  if config:
    with open(os.path.join(dst, "config.json")) as f:
      hf = json.load(f)
    hf.update(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
      json.dump(hf, f)
  return dst


@pytest.mark.parametrize("name, carry, edit, message", [
    ("deepseek", "raw", dict(config={"n_routed_experts": 8}), "n_routed_experts=8: mixture-of-experts"),
    ("deepseek", "raw", dict(config={"kv_lora_rank": 512}), "kv_lora_rank=512: multi-head latent"),
    ("mimo", "", dict(drop=["model.mtp_layers.0.hidden_layernorm.weight"]),
     "missing tensor model.mtp_layers.0.hidden_layernorm.weight"),
    ("mimo", "", dict(reshape="model.mtp_layers.0.input_proj.weight"),
     "tensor model.mtp_layers.0.input_proj.weight has shape (64, 64), config.json implies (64, 128)"),
    ("deepseek", "raw", dict(config={"num_nextn_predict_layers": 3}),
     "num_nextn_predict_layers=3: the weights hold 2"),
    ("medusa", "", dict(drop=["1.2.weight"]), "missing tensor 1.2.weight"),
])
def test_refusals_name_the_tensor_or_field(shipped, tmp_path, name, carry, edit, message):
  path = _copy(shipped, tmp_path, name, carry, **edit)
  with pytest.raises(hf_lib.HFImportError) as e:
    hf_lib.import_model(path, str(tmp_path / "out"), HeadsConfig())
  assert message in str(e.value) and "\n" not in str(e.value)
  assert not os.path.exists(tmp_path / "out")


def test_layout_none_adds_fresh_heads(shipped, tmp_path):
  _, note = hf_lib.import_model(shipped["mimo", ""][1], str(tmp_path / "o"), HeadsConfig(num=2),
                                mtp_layout="none")
  assert "fresh parallel heads" in note and "mimo MTP layers left out" in note
  with pytest.raises(hf_lib.HFImportError, match="mtp_layout='medusa': the checkpoint holds mimo"):
    hf_lib.import_model(shipped["mimo", ""][1], str(tmp_path / "p"), HeadsConfig(),
                        mtp_layout="medusa")


@pytest.mark.parametrize("name, carry", CASES[:3])
def test_decode_drafts_equal_the_full_recomputation(shipped, name, carry):
  """The drafts the engine holds after prefill and after decode steps (the modules' caches
  updated in the step), and their confidences (the peak probability, kept where a threshold
  reads them), are the heads' recomputed over the whole committed sequence."""
  import jax
  from mtp_jax.decoding import engine as E
  _, _, ours = shipped[name, carry]
  m, mcfg, hcfg, params, tok = _ours(ours)
  k = 2
  eng = E.Engine(mcfg, hcfg, DecodeConfig(batch_size=2, k=k, ring_size=8, max_len=128,
                                          confidence_threshold=1e-9), tok.eod_id)
  prompts = [tok.encode(TEXT[:30]), tok.encode("class P")]
  state = eng.init_state()
  pre = eng.prefill(params, prompts, jnp.stack([jax.random.key(0)] * 2), [0.0] * 2, [0] * 2,
                    [1.0] * 2)
  state = eng.insert(pre, state, [0, 1], [60, 60], [0.0] * 2, [0] * 2, [1.0] * 2)
  for steps in (0, 5):
    state = eng.generate(params, state, steps) if steps else state
    for r in range(2):
      n = int(state.rows.length[r])
      seq = np.asarray(state.rows.tokens[r, :n]).tolist()
      drafts = np.asarray(state.drafts.tokens[r, :k]).tolist()
      h, _ = m(jnp.asarray([seq]), jnp.arange(n)[None])
      # module 1 at trunk position n-2 reads the last token and predicts token n
      logits = np.asarray(m.head_logits(h, jnp.asarray([seq + drafts])))[0, n - 2]
      conf = np.asarray(state.drafts.conf[r, :k])
      for i in range(hcfg.num):         # module 2 reads draft 1 as its input token
        assert drafts[i] == logits[i].argmax(), (steps, r, i)
        np.testing.assert_allclose(conf[i], np.exp(logits[i].max() - np.logaddexp.reduce(
            logits[i])), rtol=1e-4, err_msg=str((steps, r, i)))


@pytest.mark.parametrize("name, carry", [("medusa", ""), ("mimo", "")])
def test_imported_heads_train(shipped, name, carry):
  """Heads-only losses reach every imported head parameter (Medusa's own lm_heads included)."""
  import jax
  from mtp_jax.models import model as model_lib
  from mtp_jax.training import losses
  _, _, ours = shipped[name, carry]
  m, mcfg, hcfg, params, tok = _ours(ours)
  graphdef, _ = model_lib.abstract(mcfg, hcfg)
  tokens = jnp.asarray(np.random.RandomState(6).randint(2, 300, (2, 24)))

  def loss(heads):
    mm = model_lib.bind(graphdef, {"trunk": params["trunk"], "heads": heads})
    _, head_losses = losses.compute_losses(mm, tokens, tok.eod_id, "heads_only")
    return jnp.sum(head_losses)

  grads = jax.grad(loss)(params["heads"])
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)


@pytest.mark.slow
def test_sampling_with_medusa_heads_is_lossless(shipped):
  """Heads with their own lm_heads draft from their own distributions: the 2nd and 3rd tokens
  of 1,536 sampled rows (top_k 4) have plain sampling's distribution."""
  from tests.helpers import assert_same_distribution, sample_engine, second_and_third
  _, _, ours = shipped["medusa", ""]
  _, mcfg, hcfg, params, tok = _ours(ours)
  plain = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=1, k=0, max_len=128))
  out = plain.run([api.Request(tok.encode("class P"), 40)])[0].token_ids
  prompt = [int(np.bincount(out).argmax())] * 8          # where the heads' drafts get accepted
  a, _ = sample_engine(mcfg, hcfg, params, tok, 0, 24, 64, prompt, 3, seed=1)
  b, st = sample_engine(mcfg, hcfg, params, tok, 3, 24, 64, prompt, 3, seed=2)
  assert sum(st["accepted"]) > 0.05 * sum(st["drafted"]), st       # the last round's counts
  assert_same_distribution(second_and_third(a), second_and_third(b))
