"""The migrated schema against models.py where alembic's autogenerate comparison does not look
(CHECK constraints), and a registry whose schema is newer than this code."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from shared.registry import InvalidState, create_registry, upgrade
from shared.registry.db import make_engine
from shared.registry.models import Base


def test_check_constraints_of_the_migrated_schema_have_the_models_names(db_url: str) -> None:
    # compare_metadata ignores CHECK constraints; a later migration that swaps one (a new artifact
    # state) addresses it by the name models.py gives it, so the database must carry that name.
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        inspector = sa.inspect(engine)
        for table in Base.metadata.sorted_tables:
            declared = {c.name for c in table.constraints if isinstance(c, sa.CheckConstraint)}
            migrated = {c["name"] for c in inspector.get_check_constraints(table.name)}
            assert migrated == declared, f"table {table.name}: migrations create {migrated}, models.py says {declared}"
    finally:
        engine.dispose()


@pytest.mark.parametrize("migrate_to_head", [True, False])
def test_a_registry_migrated_by_newer_code_is_refused_saying_so(db_url: str, migrate_to_head: bool) -> None:
    create_registry(db_url).close()
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
    finally:
        engine.dispose()
    with pytest.raises(InvalidState, match="'9999_from_the_future'.*newer version"):
        create_registry(db_url, migrate_to_head=migrate_to_head)
