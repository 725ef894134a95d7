"""Line editing and history for ``anygpu chat``: the stdlib ``readline`` where it exists (GNU readline or
libedit), plain ``input()`` where it does not (Windows) or when stdin is not a terminal (a script piping lines
in should neither read nor grow the user's history).

The history lives in the user's cache directory (``$XDG_CACHE_HOME/anygpu/chat_history``, else
``~/.cache/anygpu/chat_history``) and keeps the last ``HISTORY_LENGTH`` lines: a prompt history is a
convenience, and a file that grows for ever is not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HISTORY_LENGTH = 1000


def history_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "anygpu" / "chat_history"


class LineEditing:
    """``with LineEditing(): input(...)``: arrow keys, Ctrl-R and the history while inside, saved on the way
    out (also when the chat ends with an exception)."""

    def __init__(self, path: Path | None = None):
        self.path = path or history_path()
        self.readline = None

    def __enter__(self):
        if not sys.stdin.isatty():
            return self
        try:
            import readline  # noqa: F401 - importing it is what makes input() edit lines
        except ImportError:  # no readline on this platform: input() still works, without editing
            return self
        self.readline = readline
        readline.set_history_length(HISTORY_LENGTH)
        try:
            readline.read_history_file(self.path)
        except OSError:  # no history yet, or an unreadable one: start empty
            pass
        return self

    def __exit__(self, *exc):
        if self.readline is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.path)  # truncated to set_history_length's bound
        except OSError:  # a read-only home: the chat worked, only its history is not kept
            pass
