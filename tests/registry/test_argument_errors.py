"""A malformed argument is refused by the registry with InvalidValue (gRPC INVALID_ARGUMENT) on both
databases, before it reaches SQL: PostgreSQL would raise a DataError or ProgrammingError (which the
servicers do not map, and which aborts the caller's transaction), and SQLite would store a value
that PostgreSQL refuses, so the two backends would disagree."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry import (
    InvalidValue,
    ModelVersion,
    create_job,
    get_artifact,
    cancel_job,
    get_deployment,
    get_job,
    list_events,
    register_model_version,
    report_progress,
    reserve_artifact,
    start_job,
    start_rollout,
)
from shared.registry.models import Artifact


@pytest.fixture
def job_id(session: Session) -> str:
    job = create_job(session, owner="host:1:boot")
    start_job(session, job.id, owner="host:1:boot")
    return job.id


CASES: list[tuple[str, Callable[[Session, ModelVersion, str], object], str]] = [
    ("a format longer than its column",
     lambda s, v, j: reserve_artifact(s, v.id, "f" * 65, "sm90"), "artifact format 'f+' is not accepted: use 1 to 64"),
    ("a GPU target longer than its column",
     lambda s, v, j: reserve_artifact(s, v.id, "fp16", "g" * 65), "GPU target 'g+' is not accepted: use 1 to 64"),
    ("a job stage longer than its column",
     lambda s, v, j: report_progress(s, j, stage="s" * 65, block_index=0, block_count=1),
     "job stage 's+' is not accepted: use 1 to 64"),
    ("a block count past a 32-bit integer",
     lambda s, v, j: report_progress(s, j, stage="pack", block_index=0, block_count=2**31),
     "job progress block 0 of 2147483648 is not accepted"),
    ("an artifact id that is not text",
     lambda s, v, j: get_artifact(s, 123), "artifact id 123 is not accepted"),
    ("no canary artifact id",
     lambda s, v, j: start_rollout(s, "chat", canary_artifact_id=None, percent=5, actor="a"),
     "artifact id None is not accepted"),
    ("a deployment name that is not text",
     lambda s, v, j: get_deployment(s, 5), "deployment name 5 is not accepted"),
    ("an event id to tail from that is not an integer",
     lambda s, v, j: list_events(s, after_id="12"), "event id to list after '12' is not accepted"),
    # PostgreSQL refuses text holding NUL (DataError); SQLite stores it or finds no row
    ("a job id holding a NUL character",
     lambda s, v, j: get_job(s, "ab\x00cd"),
     "quantization job id 'ab.x00cd' is not accepted: it holds a NUL character"),
    ("a cancel reason holding a NUL character",
     lambda s, v, j: cancel_job(s, j, actor="ops", reason="bad\x00"),
     "cancel reason 'bad.x00' is not accepted: it holds a NUL character"),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_malformed_argument_is_an_invalid_value(
    session: Session, version: ModelVersion, job_id: str, call: Callable, message: str
) -> None:
    with pytest.raises(InvalidValue, match=message):
        call(session, version, job_id)
    session.execute(sa.text("SELECT 1"))  # the transaction is still usable (PostgreSQL aborts it on an error)


def test_the_longest_accepted_names_fit_the_object_prefix_column(session: Session) -> None:
    version = register_model_version(session, "m" * 128, "h" * 128, label="l" * 128)
    artifact = reserve_artifact(session, version, "f" * 64, "g" * 64).artifact
    session.flush()
    assert session.get(Artifact, artifact.id).object_prefix.startswith("m" * 128 + "/" + "h" * 128 + "/")


@pytest.mark.parametrize("folder", ["demo?a", "demo%41", "demo#1"])
def test_a_sqlite_registry_stays_in_its_folder_whatever_the_folder_is_called(tmp_path, folder) -> None:
    """The path was pasted into the URL: `qctl up --workdir 'demo?a'` opened the file `demo` beside the folder (and
    shared it with every `demo?...`); 'demo%41' opened 'demoA'."""
    from shared.registry import create_registry, sqlite_url

    (tmp_path / folder).mkdir()
    create_registry(sqlite_url(tmp_path / folder / "registry.db")).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder]
    assert (tmp_path / folder / "registry.db").is_file()
