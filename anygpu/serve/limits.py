"""The HTTP edge's limits: what one connection may cost before any route sees it.

Defaults follow the production servers' (Apache's ``LimitRequestLine`` 8190 and ``LimitRequestFields`` 100,
nginx's 8 KiB request-line buffer, uvicorn's 5 s keep-alive, Node's header timeout that counts the whole head):

=====================  =======  ======  ===============================================================
field                  default  status  what it bounds
=====================  =======  ======  ===============================================================
max_request_line       8192 B   414     method, target and version
max_header_bytes       65536 B  431     request line and header lines together
max_headers            100      431     header lines
header_timeout         20 s     408     from the connection (or a keep-alive request's first byte) to the
                                        end of the headers; a connection that sent nothing is just closed
body_timeout           60 s     408     from the end of the headers to the end of the body (4 MiB at the
                                        default ``max_body_bytes`` needs 70 KB/s)
keep_alive_timeout     5 s      --      an idle connection between requests is closed
max_connections        2048     503     open connections; one above it gets a JSON 503 with Retry-After
                                        once its headers are in, then is closed
=====================  =======  ======  ===============================================================

The timeouts are deadlines for the whole head or body, not per read: a client sending one byte every few seconds
(slowloris) is cut at the deadline all the same.  Sizes are checked on every read, so a head is refused at most
one socket read (256 KiB) past its limit, before it is parsed further.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class EdgeLimits:
    max_request_line: int = 8192
    max_header_bytes: int = 64 << 10
    max_headers: int = 100
    header_timeout: float = 20.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 2048

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{f.name}: expected a positive int, got {value!r}")
            elif (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                  or value <= 0):
                raise ValueError(f"{f.name}: expected a positive number of seconds, got {value!r}")
