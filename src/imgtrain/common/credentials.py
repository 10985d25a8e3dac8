"""URLs as they may be shown: without the credentials a URL can carry (`scheme://user:password@host/...`, or a
database URL's `?password=...`). An object-storage endpoint and an Optuna storage URL both may hold a password; what
is printed, logged or written into a run's files never does."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl

_USERINFO = re.compile(r"(?<=://)[^/\s]*@")  # up to the last '@' before the host: a password may hold '@'
_QUERY_SECRETS = ("password", "passwd", "pwd")  # the query keys database drivers read a password from
_SHORTEST_MASKED = 4  # a secret shorter than this is not replaced in free text: it would blank out ordinary words


def without_userinfo(text: str) -> str:
    """`text` with every URL's `user:password@` removed."""
    return _USERINFO.sub("", text)


def url_secrets(url: str) -> list[str]:
    """The passwords `url` holds: the one after `user:` before the host, and any `?password=` (passwd, pwd)."""
    rest = url.split("://", 1)[-1]
    authority = rest.split("/", 1)[0]
    userinfo = authority[: authority.rfind("@")] if "@" in authority else ""
    found = [userinfo.split(":", 1)[1]] if ":" in userinfo else []
    query = rest[len(userinfo) :].partition("?")[2]
    found += [value for key, value in parse_qsl(query, keep_blank_values=True) if key.lower() in _QUERY_SECRETS]
    return [secret for secret in found if secret]


def masked(text: str, url: str) -> str:
    """`text` (a message that may quote `url`) without `url`'s credentials: every URL's userinfo removed, each of
    `url`'s query passwords shown as `***`, and its passwords replaced wherever else they appear."""
    text = without_userinfo(text)
    for key in _QUERY_SECRETS:
        text = re.sub(rf"(?i)([?&]{key}=)[^&\s'\"]*", r"\1***", text)
    for secret in url_secrets(url):
        if len(secret) >= _SHORTEST_MASKED:
            text = text.replace(secret, "***")
    return text
