"""Checks of the paths a user names, made before anything is opened or written.

* ``check_regular``: only regular files are read. Opening a FIFO waits for a
  writer for ever, a device such as /dev/zero never ends, a socket cannot be
  opened at all: each is refused from ``os.stat`` (symlinks followed), before
  ``open``.
* ``check_inside``: a file of a directory (a Hugging Face checkpoint's) must
  resolve inside it, symlinks included: a link out of it would copy what it
  points at (a private key) into the output.
* ``check_length``: a directory a run writes into, and the longest path it
  writes below it, fit the file system's name and path limits (``pathconf``).

Each raises ValueError with one line naming the path. No JAX here:
trainer.prepare's workers import it.
"""

from __future__ import annotations

import os
import stat

KINDS = ((stat.S_ISDIR, 'a directory'), (stat.S_ISFIFO, 'a FIFO (named pipe)'),
         (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'),
         (stat.S_ISSOCK, 'a socket'))


def kind(path: str) -> str | None:
  """None for a regular file (or a link to one); else what ``path`` is, in words."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    return 'missing' if not os.path.islink(path) else 'a link to nothing'
  except OSError as e:
    return f'unreadable ({e.strerror})'
  if stat.S_ISREG(mode):
    return None
  return next((name for test, name in KINDS if test(mode)), 'not a regular file')


def check_regular(path: str, what: str) -> None:
  """ValueError ``'{what}{path}: a FIFO (named pipe), not a regular file'`` and the like."""
  found = kind(path)
  if found is not None:
    raise ValueError(f'{what}{path}: ' + ('does not exist' if found == 'missing' else
                                          f'{found}, not a regular file (only regular '
                                          'files are read)'))


def check_inside(root: str, path: str, what: str) -> None:
  """ValueError unless ``path`` resolves (symlinks followed) inside directory ``root``."""
  top, real = os.path.realpath(root), os.path.realpath(path)
  if os.path.commonpath([top, real]) != top:
    raise ValueError(f'{what}{path} resolves to {real}, outside {root}: only files inside '
                     'it are read')


def _limits(path: str) -> tuple[int, int]:
  """(PC_NAME_MAX, PC_PATH_MAX) of the file system ``path`` (or its nearest parent) is on."""
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  try:
    return os.pathconf(existing, 'PC_NAME_MAX'), os.pathconf(existing, 'PC_PATH_MAX')
  except (OSError, ValueError):  # a file system that does not say: POSIX's usual limits
    return 255, 4096


def check_length(path: str, what: str, below: int = 0) -> None:
  """ValueError when ``path``, or a path ``below`` bytes longer under it, is too long.

  Names are counted in the bytes the file system stores; the path is absolute.
  """
  full = os.path.abspath(path)
  name_max, path_max = _limits(full)
  short = full if len(full) <= 80 else full[:60] + '...' + full[-17:]
  for name in full.split(os.sep):
    if len(os.fsencode(name)) > name_max:
      raise ValueError(f'{what}{short}: a name of {len(os.fsencode(name))} bytes '
                       f'({name[:20]}...), more than the {name_max} this file system allows')
  size = len(os.fsencode(full))
  if size + below > path_max:
    raise ValueError(f'{what}{short}: {size} bytes long' + (
        f', plus up to {below} for the files written below it,' if below else ',')
                     + f' more than the {path_max} the system allows: use a shorter path')
