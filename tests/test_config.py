"""The typed config: every key documented, converted once, misspellings named; layers in order."""

import ast
import dataclasses
import glob
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from trainer import config as config_lib, train

DEFAULT = os.path.join(ROOT, 'configs', 'default.py')


def test_the_defaults_are_configs_default_py():
  # but for collective_matmul: 'auto' everywhere by default, which on CPU decomposes
  # nothing (nothing overlaps there); the demo sets 'always' to show the technique.
  want = config_lib.Config()
  want = dataclasses.replace(want, parallelism=dataclasses.replace(
      want.parallelism, collective_matmul='always'))
  assert config_lib.load(DEFAULT) == want


@pytest.mark.parametrize('path', sorted(set(glob.glob(os.path.join(ROOT, 'configs', '**', '*.py'),
                                                      recursive=True))
                                        - set(glob.glob(os.path.join(ROOT, 'configs', '**',
                                                                     '__init__.py'),
                                                        recursive=True))
                                        - {os.path.join(ROOT, 'configs', 'finetune.py'),
                                           os.path.join(ROOT, 'configs', 'calibration',
                                                        'maxtext.py')}))
def test_every_config_file_converts_and_validates(path):
  config_lib.load(path).validate()


@pytest.mark.parametrize('module', ['trainer.train', 'trainer.evaluate', 'launch.aot'])
def test_help_lists_every_key_with_its_type_and_default(module):
  proc = subprocess.run([sys.executable, '-m', module, '--help'], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = ' '.join(proc.stdout.split())  # help wraps long lines
  shown = config_lib._shown_type  # pylint: disable=protected-access
  for key, kind in config_lib.key_types().items():
    assert f'config.{key} ({shown(kind)}, default ' in text, key
  assert 'config.optimizer.learning_rate (float, default 0.004): peak learning rate' in text


def test_a_misspelled_key_exits_2_suggesting_the_right_one(tmp_path, capsys):
  code = train.main(['--config', DEFAULT, '--workdir', str(tmp_path / 'run'),
                     '--config.optimizer.lerning_rate=1e-3'])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1, err
  assert err == ('error: unknown config key: config.optimizer.lerning_rate '
                 '(did you mean config.optimizer.learning_rate?)')
  assert not (tmp_path / 'run').exists()


def test_a_key_misspelled_in_a_config_file_is_named(tmp_path):
  (tmp_path / 'typo.py').write_text('from configs import default\n\ndef get_config():\n'
                                    '  c = default.get_config()\n  c.model.d_modle = 64\n'
                                    '  return c\n')
  with pytest.raises(config_lib.ConfigError, match=r'config.model.d_modle \(did you mean '
                                                   r'config.model.d_model\?\)'):
    config_lib.load(str(tmp_path / 'typo.py'))


def test_overrides_are_typed_and_the_config_is_frozen():
  cfg = config_lib.load(DEFAULT, ['--config.stop_after=5', '--config.optimizer.b1=1',
                                  "--config.mesh.logical_axis_rules=[['batch', None]]"])
  assert cfg.stop_after == 5 and cfg.optimizer.b1 == 1.0 and isinstance(cfg.optimizer.b1, float)
  assert cfg.mesh.logical_axis_rules == (('batch', None),)
  assert cfg.replace({'model.d_model': 64}).model.d_model == 64 and cfg.model.d_model == 128
  with pytest.raises(AttributeError):
    cfg.model.d_model = 1  # frozen: nothing below the entry point changes it
  with pytest.raises(config_lib.ConfigError, match="config.stop_after='x' is not a valid int"):
    config_lib.load(DEFAULT, ['--config.stop_after=x'])


def test_configs_readme_is_generated_from_the_dataclasses():
  with open(os.path.join(ROOT, 'configs', 'README.md'), encoding='utf-8') as f:
    assert f.read() == config_lib.markdown(), (
        'configs/README.md is stale: python -m trainer.config --markdown > configs/README.md')


def _imports(path: str) -> set[str]:
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
  return names


@pytest.mark.parametrize('lower, upper', [('trainer', 'launch'), ('models', 'trainer'),
                                          ('models', 'launch'), ('parallelism', 'trainer'),
                                          ('parallelism', 'launch')])
def test_no_module_imports_from_a_layer_above_it(lower, upper):
  bad = [f'{os.path.relpath(p, ROOT)} imports {name}'
         for p in sorted(glob.glob(os.path.join(ROOT, lower, '*.py')))
         for name in _imports(p) if name == upper or name.startswith(upper + '.')]
  assert not bad, bad
