"""Loading a config file and applying ``--config.a.b=value`` overrides.

A config file is a Python module with ``get_config()`` returning an
``ml_collections.ConfigDict`` (``path.py`` or ``path.py:arg`` to pass an
argument). Overrides must name existing keys and keep each field's type.
Every problem raises :class:`ConfigError` with a one-line message; the entry
point turns it into exit status 2.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from typing import Sequence

import ml_collections


class ConfigError(ValueError):
  """Bad user input: reported as one line, exit status 2."""


def load(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads ``spec`` (``file.py[:arg]``) and applies ``--config.k=v`` overrides."""
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise ConfigError(f'config file not found: {path}')
  module_spec = importlib.util.spec_from_file_location('_run_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, 'get_config'):
    raise ConfigError(f'config file {path} has no get_config()')
  try:
    cfg = module.get_config(arg) if arg else module.get_config()
  except ValueError as e:  # a config that refuses its argument
    raise ConfigError(f'{spec}: {e}') from None
  for key, raw in parse_overrides(overrides):
    set_value(cfg, key, raw)
  return cfg


def parse_overrides(args: Sequence[str]) -> list[tuple[str, str]]:
  """``['--config.a=1', '--config.b', '2']`` -> ``[('a', '1'), ('b', '2')]``."""
  out, i = [], 0
  while i < len(args):
    arg = args[i]
    if not arg.startswith('--config.'):
      raise ConfigError(f'unrecognized argument: {arg}')
    key, eq, raw = arg[len('--config.'):].partition('=')
    if not eq:
      if i + 1 >= len(args):
        raise ConfigError(f'no value given for --config.{key}')
      raw, i = args[i + 1], i + 1
    out.append((key, raw))
    i += 1
  return out


def set_value(cfg: ml_collections.ConfigDict, key: str, raw: str) -> None:
  """Sets dotted ``key`` from string ``raw``, parsed as the field's type."""
  *parents, leaf = key.split('.')
  node = cfg
  for i, part in enumerate(parents):
    if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
      raise ConfigError(f'unknown config key: config.{".".join(parents[:i + 1])}')
    node = node[part]
  if leaf not in node:
    raise ConfigError(f'unknown config key: config.{key}')
  field_type = node.get_ref(leaf).get_type()
  try:
    value = _parse(raw, field_type)
    node[leaf] = value
  except (TypeError, ValueError, SyntaxError):
    raise ConfigError(f'config.{key}={raw!r} is not a valid '
                      f'{getattr(field_type, "__name__", field_type)}') from None


def _parse(raw: str, field_type: type):
  if field_type is not str and raw.lower() == 'none':
    return None  # the ConfigDict refuses None for fields that are not optional
  if field_type is bool:
    low = raw.lower()
    if low not in ('true', 'false', '1', '0'):
      raise ValueError(raw)
    return low in ('true', '1')
  if field_type is str:
    return raw
  if field_type is int:
    return int(raw)
  if field_type is float:
    return float(raw)
  return ast.literal_eval(raw)
