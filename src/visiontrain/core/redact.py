"""URLs as the tool prints and writes them: without the secrets a user put in them.

A storage URL (``tune --storage postgresql://user:secret@host/db``), a tracking URI or a shard URL
can carry a password or a token, in its user info or in a query parameter (``?password=...``,
``?token=...``, a presigned URL's ``X-Amz-Signature``). Every message and file that names such a URL
names it through ``redact_url``; only the connection itself is given the URL as written.

Passing secrets in the environment instead (``PGPASSWORD``, ``AWS_SECRET_ACCESS_KEY``,
``MLFLOW_TRACKING_PASSWORD``) keeps them out of commands and configs too (docs/tracking.md).
"""
from __future__ import annotations

import re

MASK = "***"
#: A query parameter whose name holds one of these words (any case) has its value masked.
SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token", "key", "signature", "credential", "auth")
_PARAM = re.compile(r"([^&;=]*)=([^&;]*)")


def redact_url(url: str) -> str:
    """``url`` with the password of its user info and the values of secret-like query parameters
    replaced by ``***``. A password may hold ``@``, ``/`` or ``:`` as typed (the user info ends at the
    last ``@`` before the query); a URL with no ``://`` is returned as it is."""
    return _redacted(url)[0]


def scrub(text: str, url: str) -> str:
    """``text`` (a driver's error message, say) with every secret of ``url`` masked, wherever it is:
    the URL whole, or its password alone."""
    redacted, secrets = _redacted(url)
    text = text.replace(url, redacted)
    pieces = {piece for secret in secrets for piece in _pieces(secret)}
    for secret in sorted(pieces, key=len, reverse=True):
        if len(secret) >= 3:  # shorter is no secret, and would mask letters of every word
            text = text.replace(secret, MASK)
    return text


def _pieces(secret: str) -> list[str]:
    """A secret, and what of it a driver quotes when it splits the URL at an ``@`` inside the password
    (psycopg reads ``u:se@cret@host`` as password ``se``, host ``cret@host``): the text before and
    after each of its ``@``."""
    parts = secret.split("@")
    return [secret, *("@".join(parts[:i]) for i in range(1, len(parts))),
            *("@".join(parts[i:]) for i in range(1, len(parts)))]


def _redacted(url: str) -> tuple[str, list[str]]:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url, []
    end = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    head, secrets = _without_password(rest[:end])
    tail = _PARAM.sub(lambda m: _masked_param(m, secrets), rest[end:])
    return f"{scheme}{sep}{head}{tail}", [s for s in secrets if s]


def _without_password(head: str) -> tuple[str, list[str]]:
    """``user:secret@host/path`` -> ``user:***@host/path``; a path that merely holds an ``@``
    (``bucket/a@b.tar``, ``host:8080/a@b``) is left as it is."""
    at = head.rfind("@")
    if at < 0:
        return head, []
    user_info, rest = head[:at], head[at + 1:]
    user, colon, password = user_info.partition(":")
    if not colon or ("/" in user_info and ("/" in user or password.split("/", 1)[0].isdigit())):
        return head, []  # no password, or a path after a host (and a port)
    return f"{user}:{MASK}@{rest}", [password]


def _masked_param(match: re.Match, secrets: list[str]) -> str:
    name, value = match.group(1), match.group(2)
    if not any(word in name.lower() for word in SECRET_WORDS):
        return match.group(0)
    secrets.append(value)
    return f"{name}={MASK}"
