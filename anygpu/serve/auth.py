"""What makes an API key usable: clients send it in an HTTP header, ``Authorization: Bearer <key>``, which
is ASCII and trimmed of surrounding spaces, so a key with any other character could never match."""

from __future__ import annotations


def key_problem(key) -> str | None:
    """Why ``key`` cannot be an API key (an "expected ..." message), or None if it can."""
    if not isinstance(key, str) or not key.strip():
        return f"expected a non-empty string, got {key!r}"
    bad = [c for c in key if not (c.isascii() and c.isprintable()) or c.isspace()]
    if bad:
        return f"expected printable ASCII without spaces (it is sent in an HTTP header), got {bad[0]!r}"
    return None
