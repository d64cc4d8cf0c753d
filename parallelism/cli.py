"""What the command-line entry points share.

Here, in the lowest package that has an entry point (``python -m parallelism.report``),
so that trainer/ and launch/ reach it too.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn

# The exit status of a process a closed pipe ended (128 + SIGPIPE), as `yes | head` gives.
BROKEN_PIPE_STATUS = 141


def run(main: Callable[[], int]) -> NoReturn:
  """``sys.exit(main())``, quietly when the reader of stdout stopped early (``| head``).

  The next write to a pipe its reader closed raises BrokenPipeError: the rest of
  the output is not wanted, so this exits without a traceback. Stdout then points
  at /dev/null, so that the interpreter's last flush at exit cannot raise again.
  """
  try:
    status = main()
    sys.stdout.flush()
  except BrokenPipeError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    status = BROKEN_PIPE_STATUS
  sys.exit(status)
