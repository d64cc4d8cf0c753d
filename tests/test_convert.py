"""Hugging Face Llama import/export: logits match transformers, refusals, round trip.

Every checkpoint here is a tiny random Llama built locally with transformers (no
download), its weights redrawn at a scale where a wrong mapping shows in the
logits (norm scales included, so swapping two norms would show too).
"""

import json
import os
import sys

import numpy as np
import pytest
from safetensors import safe_open

from trainer import convert
from trainer.hints import install_hint

# Its module fixture is costly: its tests stay on one worker under make test's
# --dist loadgroup, so the fixture is built once (pytest 9.1; see constraints.txt).
pytestmark = pytest.mark.xdist_group('test_convert')

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
transformers.logging.set_verbosity_error()

TINY = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
            rope_theta=500.0, rms_norm_eps=1e-5)


def make_hf(directory, dtype=torch.float32, max_shard_size=None, seed=0, base_model=False,
            **overrides):
  """Saves a random LlamaForCausalLM (safetensors) to ``directory``; returns its path.

  ``base_model`` saves only its LlamaModel (key names without ``model.``, no lm_head).
  """
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **overrides}))
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.copy_(1 + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0, p.shape[1] ** -0.5 if p.shape[0] != model.config.vocab_size else 1)
  kw = {'max_shard_size': max_shard_size} if max_shard_size else {}
  model = model.model if base_model else model
  model.to(dtype).save_pretrained(str(directory), safe_serialization=True, **kw)
  return str(directory)


def hf_dtypes(hf_dir):
  out = {}
  for name in os.listdir(hf_dir):
    if name.endswith('.safetensors'):
      with safe_open(os.path.join(hf_dir, name), framework='np') as f:
        out.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
  return out


@pytest.mark.parametrize('case, overrides, scan', [
    ('gqa_untied', {}, False),
    ('tied_odd_vocab', {'vocab_size': 99, 'tie_word_embeddings': True}, False),
    ('head_dim_16', {'head_dim': 16}, True),  # 16 != hidden 32 / 4 heads
    ('bf16', {'dtype': torch.bfloat16}, False),  # numpy has no bf16: read from raw bytes
    ('fp16', {'dtype': torch.float16}, False),
    ('sharded', {'max_shard_size': '20KB'}, True),
    ('llama_model_keys', {'base_model': True, 'tie_word_embeddings': True}, False),
])
def test_imported_logits_match_transformers(tmp_path, case, overrides, scan):
  hf_dir = make_hf(tmp_path / case, **overrides)
  cfg, params = convert.import_hf(hf_dir, scan_layers=scan)
  hf = json.load(open(os.path.join(hf_dir, 'config.json')))
  assert (cfg.vocab_size, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.norm_eps,
          cfg.tie_embeddings, cfg.scan_layers) == (
              hf['vocab_size'], 2, hf.get('head_dim', 8), 500.0, 1e-5,
              hf['tie_word_embeddings'], scan)
  assert ('unembed_dv' in params) != cfg.tie_embeddings
  dtypes = hf_dtypes(hf_dir)
  assert set(dtypes.values()) == {{'bf16': 'BF16', 'fp16': 'F16'}.get(case, 'F32')}
  if case == 'sharded':
    assert os.path.exists(os.path.join(hf_dir, convert.INDEX_FILE))
    assert len(convert.weight_files(hf_dir)) > 1
  assert any(k.startswith('model.') for k in dtypes) != (case == 'llama_model_keys')
  tokens = convert.check_tokens(cfg)
  want = convert.hf_logits(hf_dir, tokens)
  got = convert.our_logits(params, cfg, tokens)
  assert got.shape == want.shape == (2, 32, cfg.vocab_size)
  assert want.std() > 0.5  # large enough that a wrong mapping could not hide
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_mapping_inverts_exactly(tmp_path):
  hf_dir = make_hf(tmp_path / 'hf', head_dim=16)
  tensors = convert.read_hf_tensors(hf_dir)
  for scan in (False, True):
    cfg = convert.model_config_from_hf(json.load(open(f'{hf_dir}/config.json')), scan)
    back = convert.params_to_hf(convert.hf_to_params(dict(tensors), cfg), cfg)
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
      np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_legacy_config_forms():
  """Older config.json files: top-level rope_theta, rope_scaling, no head_dim/kv heads."""
  base = {**TINY, 'architectures': ['LlamaForCausalLM'], 'model_type': 'llama'}
  del base['num_key_value_heads']
  cfg = convert.model_config_from_hf({**base, 'rope_scaling': {'rope_type': 'default'}})
  assert (cfg.rope_theta, cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (
      500.0, 4, 8, False)
  cfg = convert.model_config_from_hf({**base, 'rope_theta': None, 'rope_scaling': None})
  assert cfg.rope_theta == 10_000.0
  cfg = convert.model_config_from_hf(
      {**base, 'rope_parameters': {'rope_type': 'default', 'rope_theta': 7.0}})
  assert cfg.rope_theta == 7.0


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  return make_hf(tmp_path_factory.mktemp('hf') / 'tiny')


def test_cli_import_checks_and_writes(hf_dir, tmp_path, capsys):
  out = tmp_path / 'out'
  assert convert.main(['hf-import', '--hf_dir', hf_dir, '--out_dir', str(out), '--check']) == 0
  text = capsys.readouterr().out
  diff = float(text.split('max |logit difference| = ')[1].split()[0])
  assert diff <= 1e-4
  assert 'reading 1 safetensors file(s)' in text and 'read 21 tensors' in text
  assert f'configs/finetune.py:{out} --workdir runs/finetune' in text
  assert os.path.isdir(out / 'checkpoints' / '0')


def test_check_fails_on_a_wrong_mapping(hf_dir, tmp_path, capsys, monkeypatch):
  """The check catches a plausible bug: gate and up projections swapped."""
  right = convert._block_to_ours

  def swapped(w, cfg):
    block = right(w, cfg)
    block['mlp']['gate_df'], block['mlp']['up_df'] = block['mlp']['up_df'], block['mlp']['gate_df']
    return block

  monkeypatch.setattr(convert, '_block_to_ours', swapped)
  out = tmp_path / 'out'
  assert convert.main(['hf-import', '--hf_dir', hf_dir, '--out_dir', str(out), '--check']) == 1
  captured = capsys.readouterr()
  assert float(captured.out.split('max |logit difference| = ')[1].split()[0]) > 1e-2
  assert 'check failed' in captured.err and not out.exists()


def test_check_without_transformers(hf_dir, tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, 'transformers', None)  # its import now fails
  out = tmp_path / 'out'
  assert convert.main(['hf-import', '--hf_dir', hf_dir, '--out_dir', str(out), '--check']) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and install_hint('hf') in err, err
  assert not out.exists()


def _edited(hf_dir, directory, **changes):
  """A copy of ``hf_dir`` with config.json keys changed (None deletes a key)."""
  os.makedirs(directory)
  for name in os.listdir(hf_dir):
    os.link(os.path.join(hf_dir, name), os.path.join(directory, name))
  path = os.path.join(directory, 'config.json')
  cfg = json.load(open(path))
  os.remove(path)  # a hard link: do not write through to the original
  cfg.update(changes)
  json.dump({k: v for k, v in cfg.items() if v is not None}, open(path, 'w'))
  return str(directory)


LLAMA3 = {'rope_type': 'llama3', 'rope_theta': 500000.0, 'factor': 8.0,
          'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
          'original_max_position_embeddings': 8192}


@pytest.mark.parametrize('changes, message', [
    ({'rope_parameters': LLAMA3}, "rope_parameters type 'llama3' is not supported"),
    ({'rope_parameters': None, 'rope_scaling': {'type': 'linear', 'factor': 2.0}},
     "rope_scaling type 'linear' is not supported"),
    ({'hidden_act': 'gelu'}, "hidden_act='gelu' is not supported"),
    ({'attention_bias': True}, 'attention_bias=true is not supported'),
    ({'architectures': ['MistralForCausalLM']}, "['MistralForCausalLM']"),
    ({'vocab_size': 101},
     'embed_tokens.weight has shape (100, 32), but config.json implies (101, 32)'),
    ({'tie_word_embeddings': True}, 'lm_head.weight differs from embed_tokens.weight'),
    ({'num_hidden_layers': 3},
     'config.json says num_hidden_layers=3, but the weights hold layers 0..1 (2 distinct)'),
    # 12 real tensors per layer, 1e8 layers claimed: refused before expecting any
    ({'num_hidden_layers': 1e8}, 'num_hidden_layers=100000000, but the weights hold layers'),
    ({'num_attention_heads': 0}, 'config.json: model.num_heads=0 must be at least 1'),
    ({'hidden_size': 'big'}, 'config.json has a size that is not a number'),
])
def test_unsupported_configs_exit_2(hf_dir, tmp_path, capsys, changes, message):
  bad = _edited(hf_dir, tmp_path / 'bad', **changes)
  out = tmp_path / 'out'
  assert convert.main(['hf-import', '--hf_dir', bad, '--out_dir', str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: ') and len(err.splitlines()) == 1 and message in err, err
  assert not out.exists()


@pytest.mark.parametrize('shard', ['../outside/model.safetensors', '/etc/model.safetensors',
                                   'sub/../../model.safetensors'])
def test_index_naming_a_shard_outside_hf_dir_is_refused(hf_dir, tmp_path, capsys, shard):
  outside = tmp_path / 'outside'
  outside.mkdir()
  os.link(os.path.join(hf_dir, 'model.safetensors'), outside / 'model.safetensors')
  bad = tmp_path / 'hf'
  os.makedirs(bad)
  os.link(os.path.join(hf_dir, 'config.json'), bad / 'config.json')
  names = convert.read_hf_tensors(hf_dir)
  (bad / convert.INDEX_FILE).write_text(json.dumps({'weight_map': {n: shard for n in names}}))
  out = tmp_path / 'out'
  assert convert.main(['hf-import', '--hf_dir', str(bad), '--out_dir', str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and f'names a shard outside {bad}: {shard!r}' in err, err
  assert not out.exists()


def test_pickle_only_is_refused(hf_dir, tmp_path, capsys):
  bad = tmp_path / 'pickled'
  os.makedirs(bad)
  os.link(os.path.join(hf_dir, 'config.json'), bad / 'config.json')
  (bad / 'pytorch_model.bin').write_bytes(b'not loaded')
  out = tmp_path / 'out'
  assert convert.main(['hf-import', '--hf_dir', str(bad), '--out_dir', str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert 'pytorch_model.bin' in err and 'safe_serialization=True' in err
  assert 'execute arbitrary code' in err and not out.exists()


@pytest.mark.parametrize('what', ['no_config', 'no_dir', 'out_not_empty'])
def test_missing_inputs_exit_2(hf_dir, tmp_path, capsys, what):
  src, out = tmp_path / 'src', tmp_path / 'out'
  if what == 'no_config':
    os.makedirs(src)
    os.link(os.path.join(hf_dir, 'model.safetensors'), src / 'model.safetensors')
  elif what == 'out_not_empty':
    src = hf_dir
    os.makedirs(out)
    (out / 'keep.txt').write_text('mine')
  assert convert.main(['hf-import', '--hf_dir', str(src), '--out_dir', str(out)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1, err
  assert {'no_config': 'config.json not found', 'no_dir': 'is not a directory',
          'out_not_empty': 'already exists and is not empty'}[what] in err
  assert os.listdir(out) == ['keep.txt'] if what == 'out_not_empty' else not out.exists()


@pytest.mark.parametrize('scan', [False, True])
def test_export_round_trip(hf_dir, tmp_path, scan):
  ckpt, exported = tmp_path / 'ckpt', tmp_path / 'exported'
  args = ['hf-import', '--hf_dir', hf_dir, '--out_dir', str(ckpt)]
  assert convert.main(args + (['--scan_layers'] if scan else [])) == 0
  assert convert.main(['hf-export', '--checkpoint', str(ckpt),
                       '--out_dir', str(exported)]) == 0
  original, back = convert.read_hf_tensors(hf_dir), convert.read_hf_tensors(str(exported))
  assert back.keys() == original.keys()
  for name, value in original.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
  tokens = np.random.default_rng(1).integers(0, TINY['vocab_size'], (2, 16))
  np.testing.assert_array_equal(convert.hf_logits(str(exported), tokens),
                                convert.hf_logits(hf_dir, tokens))
  with open(exported / 'config.json') as f:  # no tokenizer known: no guessed ids
    hf = json.load(f)
  assert hf['eos_token_id'] is None and hf['bos_token_id'] is None


def test_export_refuses_a_missing_checkpoint(tmp_path, capsys):
  out = tmp_path / 'out'
  assert convert.main(['hf-export', '--checkpoint', str(tmp_path / 'none'),
                       '--out_dir', str(out)]) == 2
  assert 'does not exist' in capsys.readouterr().err and not out.exists()


def test_import_carries_the_tokenizer_to_generate_and_finetune(hf_dir, tmp_path, capsys):
  """tokenizer.json and tokenizer_config.json travel with the checkpoint and are used."""
  from tokenizers import Tokenizer, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  from trainer import config as config_lib, generate, tokenizer  # pylint: disable=g-import-not-at-top
  src, out = tmp_path / 'src', tmp_path / 'out'
  os.makedirs(src)
  for name in os.listdir(hf_dir):
    os.link(os.path.join(hf_dir, name), src / name)
  vocab = {w: i for i, w in enumerate(['<unk>', '</s>'] + [f'w{i}' for i in range(90)])}
  words = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  words.pre_tokenizer = pre_tokenizers.Whitespace()
  words.save(str(src / 'tokenizer.json'))
  (src / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '</s>'}))
  assert convert.main(['hf-import', '--hf_dir', str(src), '--out_dir', str(out)]) == 0
  assert 'copied the tokenizer (tokenizer.json, tokenizer_config.json)' in capsys.readouterr().out
  assert tokenizer.for_checkpoint(str(out)) == str(out / 'tokenizer.json')
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cfg = config_lib.load(f'{os.path.join(root, "configs", "finetune.py")}:{out}')
  assert cfg.data.tokenizer == str(out / 'tokenizer.json')
  assert generate.main(['--checkpoint', str(out), '--prompt', 'w1 w2 w3',
                        '--max_new_tokens', '4']) == 0
  text = capsys.readouterr()
  assert f'tokenizer {out / "tokenizer.json"} (92 tokens)' in text.err
  assert text.out.startswith('w1 w2 w3')
  # ... and back out: Hugging Face's generate stops at its end-of-document token, 1 here
  assert convert.main(['hf-export', '--checkpoint', str(out), '--out_dir',
                       str(tmp_path / 'exported')]) == 0
  with open(tmp_path / 'exported' / 'config.json') as f:
    assert json.load(f)['eos_token_id'] == 1
  assert (tmp_path / 'exported' / 'tokenizer.json').read_bytes() == (
      out / 'tokenizer.json').read_bytes()
