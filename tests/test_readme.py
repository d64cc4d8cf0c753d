"""Every command in the shell blocks of README.md and docs/*.md runs as written: modules exist,
flags parse; every relative link in README.md, CHANGELOG.md and docs/*.md resolves.

Commands are not run (they train, compile for TPUs or need a pod); instead each
``python -m MODULE`` must answer ``--help``, every ``--flag`` it uses must be one
that help lists, and ``--config FILE --config.key=value ...`` must load (keys
exist, values parse). ``make TARGET`` must be a Makefile target. Other commands
(gcloud, tensorboard, pip, ...) are left alone.
"""

import functools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from trainer import config as config_lib

PYTHON = re.compile(r'^(?:\S*/)?python3?$')  # python, python3, .venv/bin/python


def _commands(path: str) -> list[list[str]]:
  with open(path, encoding='utf-8') as f:
    text = f.read()
  commands = []
  for block in re.findall(r'```(?:sh|bash)\n(.*?)```', text, re.S):
    for line in block.replace('\\\n', ' ').splitlines():
      line = line.split(' #')[0].strip()
      if line and not line.startswith('#'):
        commands.append(shlex.split(line))
  return commands


DOCS = sorted(os.path.join('docs', p) for p in os.listdir(os.path.join(ROOT, 'docs'))
              if p.endswith('.md'))
PAGES = ('README.md', *DOCS)  # every page whose commands a user copies
README_COMMANDS = _commands(os.path.join(ROOT, 'README.md'))
COMMANDS = [c for page in PAGES for c in _commands(os.path.join(ROOT, page))]


@functools.cache
def _help(module: str) -> str:
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  proc = subprocess.run([sys.executable, '-m', module, '--help'], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, f'python -m {module} --help: {proc.stderr[-1500:]}'
  return proc.stdout


def _python_module(argv):
  if len(argv) > 2 and PYTHON.match(argv[0]) and argv[1] == '-m':
    return argv[2], argv[3:]
  return None, None


def test_the_readme_has_the_two_commands_and_python_commands():
  assert ['make', 'train'] in [c[:2] for c in README_COMMANDS]
  assert ['make', 'test'] in [c[:2] for c in README_COMMANDS]
  assert sum(_python_module(c)[0] is not None for c in README_COMMANDS) >= 10


def test_the_readme_says_how_to_install_and_run_on_its_first_screen():
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    lines = f.read().splitlines()
  first = next(i for i, line in enumerate(lines) if line.startswith('## '))
  assert lines[first] == '## Install and run' and first < 40, (first, lines[first])
  assert 'make train' in '\n'.join(lines[first:first + 10])


def _links(page: str) -> list[str]:
  with open(os.path.join(ROOT, page), encoding='utf-8') as f:
    text = re.sub(r'```.*?```', '', f.read(), flags=re.S)
  return [t for t in re.findall(r'\]\(([^)\s]+)\)', text) if '://' not in t]


LINKED = ['CHANGELOG.md', *PAGES]


@pytest.mark.parametrize('page', LINKED)
def test_relative_links_resolve(page):
  """A link to a file names one that exists; one to ``#anchor`` names a heading there."""
  bad = []
  for target in _links(page):
    path, _, anchor = target.partition('#')
    file = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else (
        os.path.join(ROOT, page))
    if not os.path.exists(file):
      bad.append(target)
    elif anchor and file.endswith('.md') and anchor not in _anchors(file):
      bad.append(target)
  assert not bad, f'{page}: links that resolve to nothing: {bad}'


def _anchors(path: str) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces '-'."""
  with open(path, encoding='utf-8') as f:
    text = re.sub(r'```.*?```', '', f.read(), flags=re.S)
  return {re.sub(r'[^\w\- ]', '', h.strip().lower()).replace(' ', '-')
          for h in re.findall(r'^#+ (.*)$', text, re.M)}


@pytest.mark.parametrize('argv', COMMANDS, ids=[' '.join(c)[:60] for c in COMMANDS])
def test_readme_command_parses(argv):
  if argv[0] == 'make':
    with open(os.path.join(ROOT, 'Makefile'), encoding='utf-8') as f:
      targets = re.findall(r'^([\w-]+):', f.read(), re.M)
    assert argv[1] in targets, argv
    return
  module, args = _python_module(argv)
  if module is None:
    pytest.skip(f'not a python -m command: {argv[0]}')
  _check(module, args)


def _check(module: str, args: list[str]) -> None:
  if '--' in args:  # a launcher: its own flags, then the command it runs on each process
    inner = args[args.index('--') + 1:]
    args = args[:args.index('--')]
    if _python_module(inner)[0]:
      _check(*_python_module(inner))
  usage = _help(module)
  flags = [a.split('=')[0] for a in args if a.startswith('--') and not a.startswith('--config.')]
  missing = [f for f in flags if not re.search(rf'(?<![\w-]){re.escape(f)}(?![\w-])', usage)]
  assert not missing, f'python -m {module}: {missing} not in its --help'
  config = args[args.index('--config') + 1] if '--config' in args else None
  if config and ':' not in config and not re.search(r'[A-Z<]', config):
    overrides = [a for a in args if a.startswith('--config.')]
    config_lib.load(os.path.join(ROOT, config), overrides)  # raises on a bad key or value


def test_the_readmes_headline_band_is_the_reports():
  """The first screen's modeled band for the 500B is docs/benchmarks/results.json's (written
  by python -m benchmarks.report), not a number typed once and left behind."""
  with open(os.path.join(ROOT, 'README.md'), encoding='utf-8') as f:
    head = '\n'.join(f.read().splitlines()[:20])
  with open(os.path.join(ROOT, 'docs', 'benchmarks', 'results.json'), encoding='utf-8') as f:
    band = json.load(f)['aot']['dense_500b']['modeled']['ours']['band']['speedup_vs_best']
  shown = ' / '.join(f'{band[k]:.2f}x' for k in ('min', 'median', 'max'))
  assert f'**{shown}**' in head and '(modeled)' in head, shown
