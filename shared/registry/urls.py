"""Registry URLs as messages and logs show them."""

from __future__ import annotations

import sqlalchemy as sa

# Secrets a URL can carry in its query as well as in user:password@ (libpq takes ?password=): never shown.
_SECRET_PARAMETERS = ("password", "sslpassword")


def shown_url(url: sa.URL | str) -> str:
    """The URL for messages and logs: a password before the host masked, one in the query left out."""
    try:
        url = sa.make_url(url)
    except (ValueError, sa.exc.ArgumentError):  # sqlalchemy's own error is no ValueError
        return "<a registry URL that cannot be parsed>"
    return url.difference_update_query(_SECRET_PARAMETERS).render_as_string(hide_password=True)


def carries_password(url: str) -> bool:
    """Whether the URL holds a password (user:password@, or libpq's ?password= / ?sslpassword=)."""
    try:
        parsed = sa.make_url(url)
    except (ValueError, sa.exc.ArgumentError):
        return False  # refused later, where the URL is opened, with its own message
    return parsed.password is not None or any(name in parsed.query for name in _SECRET_PARAMETERS)

