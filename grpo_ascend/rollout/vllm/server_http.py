"""One JSON request to one vLLM server, retried on timeouts and dropped connections.

A refused connection (nothing listens on the port: the server is gone) is not retried: a pool of
servers drops it at once and sends its requests to the others. An HTTP error answer is
:class:`ServerError` (the server is alive and said no); a server that stays unreachable is
:class:`ServerGone`, one line naming the URL.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from grpo_ascend.errors import RolloutError

logger = logging.getLogger(__name__)

#: What a stopped server looks like; a pool drops it and carries on with the others.
RESUME_HINT = "restart it and resume from the last checkpoint (resume_from_checkpoint=True)"


class ServerGone(RolloutError):
    """A vLLM server stopped answering (after retries), or every server of a pool did; ``reason``: what failed."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class ServerError(RuntimeError):
    """A vLLM server answered a request with an error."""


def request_json(base_url: str, method: str, path: str, body: dict[str, Any] | None = None, *,
                 timeout: float, retries: int) -> Any:
    """``method path`` on the server at ``base_url``; the decoded answer (None if empty).

    Timeouts and reset connections are tried ``retries`` more times; a refused connection is
    :class:`ServerGone` at once.
    """
    url = f"{base_url}{path}"
    data = None if body is None else json.dumps(body).encode()
    tries = 1 + max(0, int(retries))
    for attempt in range(tries):
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
            return decoded(raw)
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise ServerError(f"vLLM server {base_url} {method} {path} answered {err.code}: {detail}") from err
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            if attempt + 1 == tries or _refused(err):
                reason = f"{method} {path}: {err}"
                raise ServerGone(f"the vLLM server at {base_url} stopped answering ({reason}); {RESUME_HINT}",
                                 reason) from None
            logger.warning("vLLM server %s %s %s failed (%s); retry %d of %d", base_url, method, path, err,
                           attempt + 1, tries - 1)
            time.sleep(min(2.0 * (attempt + 1), 10.0))
    raise AssertionError("unreachable")


def _refused(err: BaseException) -> bool:
    """Whether nothing listens at the address (the server process is gone, or not started yet)."""
    reason = getattr(err, "reason", err)
    return isinstance(reason, ConnectionRefusedError)


def decoded(raw: bytes) -> Any:
    """A response body: JSON when it is JSON, else its text (some endpoints answer plain text); None if empty."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
