"""Alembic environment. Run through shared.registry.migrate, which hands over an open connection."""

from alembic import context

from shared.registry.models import Base

config = context.config
connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "registry migrations need a connection: call shared.registry.migrate.upgrade(url) or "
        "shared.registry.migrate.downgrade(url, revision), not the alembic command line"
    )

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER most things in place
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
