"""Registry URLs as messages and logs show them."""

from __future__ import annotations

import sqlalchemy as sa

# Secrets a URL can carry in its query as well as in user:password@ (libpq takes ?password=): never shown.
_SECRET_PARAMETERS = ("password", "sslpassword")


def shown_url(url: sa.URL | str) -> str:
    """The URL for messages and logs: a password before the host masked, one in the query left out."""
    try:
        url = sa.make_url(url)
    except ValueError:
        return "<a registry URL that cannot be parsed>"
    return url.difference_update_query(_SECRET_PARAMETERS).render_as_string(hide_password=True)
