"""Credentials never reach a user: the one place that masks them.

Every text that can leave the fabric towards a person or another program (source and
query errors, their hints, diagnostics of ``validate`` and ``explain``, CLI output, the
``fabric serve`` log, the error kept in ``/v1/freshness``) goes through :func:`mask`.
It hides credentials in two ways:

- **by shape**, in any text: the password of a URL's user info
  (``mongodb://fabric:***@127.0.0.1``) and its credential-named query parameters
  (``?token=***``), and the value of a secret-named key (``password=***``,
  ``'sasl.password': '***'``, ``secret_key: ***``);
- **by value**: every secret a connection was configured with (a URL's password, S3
  ``access_key`` / ``secret_key``, Kafka ``sasl.*`` / ``ssl.*`` passwords, any option
  named like a secret) is remembered when the connection is created
  (:func:`remember`, called by ``connectors.base.Connection``) and replaced by ``***``
  wherever it appears, e.g. when a driver echoes it in an error. Values shorter than
  :data:`MIN_LITERAL` characters are masked by shape only, so that a test password such
  as ``fabric`` does not erase every word ``fabric`` from the messages.

    >>> mask_url("mongodb://fabric:pw@127.0.0.1:27017/?directConnection=true")
    'mongodb://fabric:***@127.0.0.1:27017/?directConnection=true'
    >>> mask("sasl.password=hunter2&x=1")
    'sasl.password=***&x=1'
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

MASK = "***"
#: remembered values at least this long are masked wherever they appear
MIN_LITERAL = 8

#: ``scheme://user:password@`` (the user may be empty)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@'\"]*:)(?P<pw>[^\s@'\"/]*)@")
#: names of options / query parameters whose value is a secret
_SECRET_NAME = (
    r"[\w.\-]*(?:password|passwd|pwd|secret|[_.]token|jaas\.config|credentials?"
    r"|private[_.]?key)[\w.\-]*"
)
#: ``name=value`` / ``name: value`` / ``'name': 'value'`` / ``"name": "value"``
_KEYVALUE = re.compile(
    rf"(?P<head>(?P<q>['\"]?)\b(?P<name>{_SECRET_NAME})(?P=q)\s*(?:=|:)\s*)"
    r"(?:'(?P<v1>[^']*)'|\"(?P<v2>[^\"]*)\"|(?P<v3>[^\s&;,'\"}\)\]]+))",
    re.IGNORECASE,
)
_SECRET_KEY = re.compile(rf"^{_SECRET_NAME}$", re.IGNORECASE)
#: a URL's query parameter that carries a credential (``?token=...``, ``&api_key=...``)
_QUERY = re.compile(
    r"(?P<head>[?&][\w.\-]*(?:token|key|sig|signature|auth|authorization|password|passwd"
    r"|pwd|secret|credentials?)=)(?P<value>[^&#\s'\"]+)",
    re.IGNORECASE,
)

_lock = threading.Lock()
_known: set[str] = set()
_pattern: re.Pattern[str] | None = None


def mask_url(url: str) -> str:
    """``url`` with the password of its user info (and secret query parameters) masked."""
    return mask(str(url))


def mask(text: Any) -> str:
    """``text`` with every credential it contains replaced by ``***``."""
    s = str(text)
    if not s:
        return s
    pat = _pattern
    if pat is not None:
        s = pat.sub(MASK, s)
    if "://" in s:
        s = _USERINFO.sub(lambda m: m["head"] + (MASK if m["pw"] else "") + "@", s)
        s = _QUERY.sub(lambda m: m["head"] + MASK, s)
    return _KEYVALUE.sub(_key_value, s)


def _key_value(m: re.Match[str]) -> str:
    value = m["v1"] if m["v1"] is not None else m["v2"] if m["v2"] is not None else m["v3"]
    if not value or value == MASK or value.upper() in ("YES", "NO"):  # "using password: NO"
        return m[0]
    q = "'" if m["v1"] is not None else '"' if m["v2"] is not None else ""
    return f"{m['head']}{q}{MASK}{q}"


def secrets_of(options: Mapping[str, Any]) -> set[str]:
    """The secret values inside a connection's options (nested mappings included)."""
    found: set[str] = set()

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v, key)
        elif isinstance(value, str):
            if key in ("access_key", "secret_key") or _SECRET_KEY.match(key):
                found.add(value)
            if "://" in value:
                found.update(_url_passwords(value))

    walk(options)
    return {s for s in found if s and s != MASK}


def _url_passwords(value: str) -> Iterable[str]:
    for m in _USERINFO.finditer(value):
        if m["pw"]:
            yield m["pw"]
            yield unquote(m["pw"])
    try:
        pw = urlsplit(value).password
    except ValueError:
        pw = None
    if pw:
        yield pw
        yield unquote(pw)


def remember(options: Mapping[str, Any]) -> None:
    """Remember the secrets of a connection's options, to be masked in every later text."""
    new = {s for s in secrets_of(options) if len(s) >= MIN_LITERAL} - _known
    if not new:
        return
    global _pattern
    with _lock:
        _known.update(new)
        # longest first, so a secret that contains another is masked whole
        alts = sorted(_known, key=len, reverse=True)
        _pattern = re.compile("|".join(map(re.escape, alts)))


class MaskingFormatter(logging.Formatter):
    """A log formatter whose output (message and traceback) has credentials masked."""

    def format(self, record: logging.LogRecord) -> str:
        return mask(super().format(record))
