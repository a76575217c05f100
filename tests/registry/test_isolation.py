"""The registry on a PostgreSQL whose default isolation is stricter than READ COMMITTED (a DBA's
`ALTER DATABASE ... SET default_transaction_isolation`, or PGOPTIONS / the URL's options). The
repository's race handling relies on READ COMMITTED: a lookup after a lost insert race sees the
winner's committed row, and a row locked FOR UPDATE is read as the other writer committed it. Under
REPEATABLE READ or SERIALIZABLE the loser of each race got an IntegrityError or a serialization
failure instead of the winner's row or its own change applied after the other's."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry import (
    Registry,
    create_deployment,
    create_registry,
    get_deployment,
    list_artifacts,
    mark_artifact_ready,
    register_model_version,
    reserve_artifact,
    set_canary_percent,
    start_rollout,
)
from tests.registry.pg_waits import wait_until_blocked
from tests.conftest import fresh_postgres_schema

pytestmark = pytest.mark.postgres


@pytest.fixture(params=["repeatable read", "serializable"])
def strict_registry(request: pytest.FixtureRequest) -> Iterator[Registry]:
    with fresh_postgres_schema("test_isolation") as url:
        url += quote(f" -cdefault_transaction_isolation={request.param.replace(' ', chr(92) + ' ')}", safe="")
        plain = sa.create_engine(url)
        try:
            with plain.connect() as conn:  # the server really defaults to the stricter level
                assert conn.execute(sa.text("SHOW default_transaction_isolation")).scalar() == request.param
        finally:
            plain.dispose()
        registry = create_registry(url)
        yield registry
        registry.close()


def _second_writer_after_the_first(
    registry: Registry, first: Callable[[Session], object], second: Callable[[Session], object]
) -> object:
    """`second` reads (its snapshot), then runs while `first`'s transaction holds the row it needs;
    `first` commits once `second` waits on it. Returns what `second` returned or raised."""
    pid: list[int] = []
    outcome: list[object] = []

    def run_second() -> None:
        try:
            with registry.transaction() as session:
                pid.append(session.scalar(sa.text("SELECT pg_backend_pid()")))
                list_artifacts(session)  # a read first, as a servicer does: the snapshot is taken here
                outcome.append(second(session))
        except BaseException as exc:  # kept for the assert, with its type
            outcome.append(exc)

    with registry.transaction() as session:
        first(session)
        thread = threading.Thread(target=run_second)
        thread.start()
        wait_until_blocked(registry, pid, "the second writer never waited on the first one")
    thread.join(timeout=30)
    assert not thread.is_alive()
    return outcome[0]


def test_the_loser_of_a_reservation_race_gets_the_winners_row(strict_registry: Registry) -> None:
    with strict_registry.transaction() as session:
        version_id = register_model_version(session, "tiny-llama", "a" * 64).id
    won = []
    lost = _second_writer_after_the_first(
        strict_registry,
        lambda s: won.append(reserve_artifact(s, version_id, "fp16", "sm90")),
        lambda s: reserve_artifact(s, version_id, "fp16", "sm90"),
    )
    assert not isinstance(lost, BaseException), lost  # before: IntegrityError / SerializationFailure
    assert won[0].created and not lost.created and lost.artifact.id == won[0].artifact.id


def test_a_change_waiting_on_another_applies_after_it(strict_registry: Registry) -> None:
    with strict_registry.transaction() as session:
        version = register_model_version(session, "tiny-llama", "a" * 64)
        ids = []
        for format in ("w4a8kv4-g128", "w4a8kv4-chn"):
            artifact = reserve_artifact(session, version, format, "sm90").artifact
            mark_artifact_ready(session, artifact.id, manifest_sha256="b" * 64, content_digest=format)
            ids.append(artifact.id)
        create_deployment(session, "chat", stable_artifact_id=ids[0], actor="t")
        start_rollout(session, "chat", canary_artifact_id=ids[1], percent=10, actor="t")
    second = _second_writer_after_the_first(
        strict_registry,
        lambda s: set_canary_percent(s, "chat", 20, actor="gateway-a"),
        lambda s: set_canary_percent(s, "chat", 50, actor="gateway-b"),
    )
    assert not isinstance(second, BaseException), second  # before: SerializationFailure (concurrent update)
    with strict_registry.sessions() as session:
        deployment = get_deployment(session, "chat")
        assert (deployment.canary_percent, deployment.revision) == (50, 4)
