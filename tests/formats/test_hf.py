"""HF import / export against transformers itself: tiny random Llama, Mistral and Qwen2 models
saved with save_pretrained(safe_serialization=True), imported, and compared on the same inputs."""

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf-test extra (make test installs it)")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from mtp_jax.config import DecodeConfig, HeadsConfig  # noqa: E402
from mtp_jax.formats import checkpoint as ckpt_lib  # noqa: E402
from mtp_jax.formats import hf as hf_lib  # noqa: E402
from mtp_jax.models import model as model_lib  # noqa: E402
from mtp_jax.serving import api  # noqa: E402

TEXT = "def add(x, y):\n    return x + y\n\nclass Point:\n    def __init__(self):\n        pass\n"
BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5)
FAMILIES = {
    # Llama 3.1 rope scaling, tied embeddings.
    "llama3_tied": ("Llama", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    # YaRN, attention biases on q/k/v/o, head_dim wider than hidden/heads, theta.
    "llama_yarn_bias": ("Llama", dict(attention_bias=True, head_dim=32, rope_theta=50000.0,
                                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 64})),
    "mistral_window": ("Mistral", dict(sliding_window=128, rope_scaling={
        "rope_type": "linear", "factor": 2.0})),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=False)),
    # Dynamic NTK equals the default rope up to max_position_embeddings.
    "qwen2_tied_dynamic": ("Qwen2", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6})),
}


def _tokenizer(path):
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator([TEXT] * 20, trainer=trainer)
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
  tok.save(os.path.join(path, "tokenizer.json"))


def _build(root, name):
  family, extra = FAMILIES[name]
  cfg = getattr(transformers, f"{family}Config")(**BASE, **extra)
  torch.manual_seed(sorted(FAMILIES).index(name))
  model = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
  with torch.no_grad():   # norms and biases start at 1 / 0: make them matter
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(torch.randn_like(p) * 0.2)
  path = os.path.join(root, name)
  model.save_pretrained(path, safe_serialization=True)
  _tokenizer(path)
  return model, path


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("hf"))
  return {name: _build(root, name) for name in FAMILIES}


def _ours(model_dir):
  mcfg, hcfg, params, tok = ckpt_lib.load_model_dir(model_dir)
  graphdef, _ = model_lib.abstract(mcfg, hcfg)
  return model_lib.bind(graphdef, params), mcfg, hcfg, params, tok


def _hf_greedy(model, ids, n):
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_k=None,
                         top_p=None, temperature=None, eos_token_id=1, pad_token_id=1)
  out = out[0, len(ids):].tolist()
  return out[:out.index(1)] if 1 in out else out    # completions end before the end token


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_matches_transformers(hf_models, tmp_path, name):
  hf_model, hf_dir = hf_models[name]
  out = str(tmp_path / "model")
  mcfg, _ = hf_lib.import_model(hf_dir, out, HeadsConfig(num=2))
  m, mcfg, hcfg, params, tok = _ours(out)
  assert tok.eod_token == "</s>" and tok.eod_id == 1
  if name == "mistral_window":
    assert mcfg.max_seq_len == 128           # capped at the window, where attention is exact

  ids = np.random.RandomState(1).randint(2, 300, (2, 48))
  with torch.no_grad():
    ref = hf_model(torch.tensor(ids)).logits.numpy()
  h, _ = m(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(48), (2, 48)))
  np.testing.assert_allclose(np.asarray(m.logits(h)), ref, atol=1e-4, rtol=0)

  # 32 greedy tokens, through the speculative decoder (fresh heads draft), equal transformers'.
  prompts = [tok.encode(TEXT[:30]), tok.encode("class P")]
  dec = api.Decoder(mcfg, hcfg, params, tok, DecodeConfig(batch_size=2, k=2, ring_size=8,
                                                           max_len=128))
  got = dec.run([api.Request(p, 32) for p in prompts])
  for p, c in zip(prompts, got):
    assert c.token_ids == _hf_greedy(hf_model, p, 32)

  # Export: transformers loads it, every tensor is bit-identical, the logits are the same.
  exp = str(tmp_path / "exported")
  hf_lib.export_model(out, exp)
  from safetensors.numpy import load_file
  a, b = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(
      os.path.join(exp, "model.safetensors"))
  assert set(a) == set(b)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  back = getattr(transformers, f"{FAMILIES[name][0]}ForCausalLM").from_pretrained(exp).eval()
  with torch.no_grad():
    np.testing.assert_array_equal(back(torch.tensor(ids)).logits.numpy(), ref)
  # The heads travel in their own file and come back with a re-import.
  assert os.path.exists(os.path.join(exp, hf_lib.HEADS_FILE))
  _, note = hf_lib.import_model(exp, str(tmp_path / "again"), HeadsConfig(num=2))
  assert hf_lib.HEADS_FILE in note


def test_native_model_exports_to_llama(trained_tiny, tmp_path):
  """A model trained here (tied, scaled logits) exports as a LlamaForCausalLM with the same
  logits."""
  _, workdir, _ = trained_tiny
  src = os.path.join(workdir, "model")
  hf_lib.export_model(src, str(tmp_path / "exp"))
  m, mcfg, *_ = _ours(src)
  hf_model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "exp")).eval()
  ids = np.random.RandomState(2).randint(0, mcfg.vocab_size, (1, 40))
  h, _ = m(jnp.asarray(ids), jnp.arange(40)[None])
  with torch.no_grad():
    ref = hf_model(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(np.asarray(m.logits(h)), ref, atol=1e-4, rtol=0)


def _edited(hf_models, tmp_path, name, **changes):
  src = hf_models[name][1]
  dst = str(tmp_path / "edited")
  shutil.copytree(src, dst)
  with open(os.path.join(dst, "config.json")) as f:
    cfg = json.load(f)
  for k, v in changes.items():
    if v is None:
      cfg.pop(k, None)
    else:
      cfg[k] = v
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  return dst


@pytest.mark.parametrize("changes, field", [
    (dict(architectures=["MixtralForCausalLM"]), "architectures=['MixtralForCausalLM']"),
    (dict(architectures=["GPT2LMHeadModel"]), "architectures=['GPT2LMHeadModel']"),
    (dict(num_local_experts=8), "num_local_experts=8"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     "rope_parameters.rope_type='longrope'"),
    (dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "su", "factor": 2.0}),
     "rope_scaling.rope_type='su'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(num_attention_heads=5), "num_attention_heads"),
])
def test_unsupported_configs_name_the_field(hf_models, tmp_path, changes, field):
  path = _edited(hf_models, tmp_path, "llama3_tied", **changes)
  with pytest.raises(hf_lib.HFImportError) as e:
    hf_lib.import_model(path, str(tmp_path / "out"), HeadsConfig(num=2))
  assert field in str(e.value)
  assert not os.path.exists(tmp_path / "out")


def test_sliding_window_and_file_errors(hf_models, tmp_path):
  with pytest.raises(hf_lib.HFImportError, match=r"max_seq_len=200: .*sliding_window=128"):
    hf_lib.import_model(hf_models["mistral_window"][1], str(tmp_path / "o"), HeadsConfig(),
                        max_seq_len=200)
  path = _edited(hf_models, tmp_path, "qwen2")
  os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "pytorch_model.bin"))
  with pytest.raises(hf_lib.HFImportError, match="pickle files are not read"):
    hf_lib.import_model(path, str(tmp_path / "o"), HeadsConfig())
  os.rename(os.path.join(path, "pytorch_model.bin"), os.path.join(path, "model.safetensors"))
  os.remove(os.path.join(path, "tokenizer.json"))
  with pytest.raises(hf_lib.HFImportError, match="missing tokenizer.json"):
    hf_lib.import_model(path, str(tmp_path / "o"), HeadsConfig())


def _cli(name, *args):
  return subprocess.run([sys.executable, "-m", name, *args], capture_output=True, text=True,
                        timeout=600)


def test_import_train_heads_serve(hf_models, tmp_path):
  """The README's path: mtp-import, mtp-train --mode=heads_only on a text corpus, mtp-infer with
  the imported tokenizer; the served text is transformers' greedy text."""
  hf_model, hf_dir = hf_models["qwen2"]
  model_dir, workdir = str(tmp_path / "model"), str(tmp_path / "run")
  r = _cli("infer.hf_import", f"--hf_model={hf_dir}", f"--output={model_dir}", "--heads.num=2")
  assert r.returncode == 0, r.stderr
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(6):
    (corpus / f"f{i}.txt").write_text(TEXT * (i + 2))
  r = _cli("train.main", "--config=configs/heads_only.py", f"--workdir={workdir}",
           f"--config.train.init_from={model_dir}", f"--config.data.corpus_dir={corpus}",
           "--config.data.glob=*.txt", "--config.data.heldout_permille=0", "--config.heads.num=2",
           "--config.data.seq_len=32", "--config.train.distill_prompt_len=8",
           "--config.train.batch_size=2", "--config.train.steps=6", "--config.train.eval_every=6",
           "--config.train.checkpoint_every=3", "--config.train.log_every=2")
  assert r.returncode == 0, r.stderr
  losses = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  head_losses = [v for rec in losses for k, v in rec.items() if k.startswith("head")]
  assert head_losses and all(np.isfinite(head_losses)) and max(head_losses) > 0
  _, _, before, _ = ckpt_lib.load_model_dir(model_dir)
  trained = os.path.join(workdir, "model")
  _, _, after, _ = ckpt_lib.load_model_dir(trained)
  assert not np.allclose(before["heads"]["w_KDE"], after["heads"]["w_KDE"])
  np.testing.assert_array_equal(before["trunk"]["embed_VD"], after["trunk"]["embed_VD"])
  assert ckpt_lib.read_meta(trained)["hf_config"]["architectures"] == ["Qwen2ForCausalLM"]

  prompts = ["def add(", "class Po"]
  (tmp_path / "in.jsonl").write_text(
      "".join(json.dumps({"id": str(i), "prompt": p, "max_new_tokens": 24}) + "\n"
              for i, p in enumerate(prompts)))
  r = _cli("infer.main", f"--model={trained}", f"--input={tmp_path / 'in.jsonl'}",
           f"--output={tmp_path / 'out.jsonl'}", "--batch_size=2")
  assert r.returncode == 0, r.stderr
  got = {rec["id"]: rec for rec in map(json.loads, open(tmp_path / "out.jsonl"))}
  tok = ckpt_lib.load_tokenizer(trained)
  for i, p in enumerate(prompts):
    ids = tok.encode(p)
    assert got[str(i)]["text"] == tok.decode(_hf_greedy(hf_model, ids, 24)), got[str(i)]
