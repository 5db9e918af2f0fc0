"""Credentials out of text that is kept: error columns, log lines, metadata.

An endpoint URL may carry a password (`https://user:pw@host`) or a key in its query
(`?api-key=...`), an error may quote an `Authorization: Bearer ...` header, and any text
may hold the value of a credential variable of this process's environment. `redact`
replaces each with `***`; it is cheap enough for every error row.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

MASK = "***"
_USERINFO = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)[^/\s@'\"]+@", re.IGNORECASE)
_SECRET_WORDS = r"(?:key|token|secret|sig|signature|password|passwd|pwd|auth|credential)"
_QUERY = re.compile(
    rf"(?P<name>[?&;][a-z0-9_.-]*{_SECRET_WORDS}[a-z0-9_.-]*=)[^&\s#'\"]*", re.IGNORECASE)
_BEARER = re.compile(r"(?P<kind>\b(?:Bearer|Basic)\s+)[A-Za-z0-9._~+/=-]+")
# Environment variables whose values are credentials, by the end of their names.
_SECRET_ENV = re.compile(r"(?:KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIALS?)(?:_ID)?$")
MIN_SECRET_LENGTH = 8  # shorter values ("1", "true") would mask ordinary words


def credential_names(environ: dict[str, str] | None = None) -> list[str]:
    """Names of the environment's credential variables (OPENAI_API_KEY,
    AWS_SECRET_ACCESS_KEY, AWS_ACCESS_KEY_ID, HF_TOKEN, ...)."""
    env = os.environ if environ is None else environ
    return sorted(name for name in env if _SECRET_ENV.search(name.upper()))


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    """Values of the credential variables set in the environment, longest first."""
    env = os.environ if environ is None else environ
    values = {value for name, value in env.items()
              if _SECRET_ENV.search(name.upper()) and len(value) >= MIN_SECRET_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] | None = None) -> str:
    """`text` with URL passwords, secret query values, bearer tokens and the values of
    `secrets` (default: the environment's credential variables) masked."""
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _QUERY.sub(lambda m: f"{m['name']}{MASK}", text)
    text = _BEARER.sub(lambda m: f"{m['kind']}{MASK}", text)
    for value in secret_values() if secrets is None else secrets:
        if value:
            text = text.replace(value, MASK)
    return text


def url_credentials(url: str) -> str | None:
    """What in `url` is a credential (a password, a secret query parameter), None if
    nothing: such a URL must not be configuration that the UI shows."""
    if _USERINFO.search(url):
        return "a user name or password before the host"
    found = _QUERY.search(url)
    return f"the query parameter {found['name'][1:-1]!r}" if found else None
