"""list_jobs as ListJobs uses it: newest first, by state and model name, at most `limit`."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from shared.registry import InvalidValue, JobState, cancel_job, create_job, list_jobs, start_job

OWNER = "host-a:101:boot1"


def test_newest_first_by_state_and_model_with_a_limit(session: Session) -> None:
    llama = [create_job(session, owner=OWNER, model_name="llama").id for _ in range(3)]
    mistral = create_job(session, owner=OWNER, model_name="mistral").id
    start_job(session, llama[1], owner=OWNER)
    cancel_job(session, llama[0], actor="alice")

    assert [j.id for j in list_jobs(session, newest_first=True)] == [mistral, *reversed(llama)]
    assert [j.id for j in list_jobs(session)] == [*llama, mistral]  # the default order is unchanged
    assert [j.id for j in list_jobs(session, model_name="llama", newest_first=True, limit=2)] == [llama[2], llama[1]]
    assert [j.id for j in list_jobs(session, states=[JobState.QUEUED], model_name="llama")] == [llama[2]]
    assert [j.id for j in list_jobs(session, states=[JobState.RUNNING, JobState.CANCELLED])] == llama[:2]
    assert list_jobs(session, model_name="unknown") == []


def test_model_name_is_checked_at_creation(session: Session) -> None:
    with pytest.raises(InvalidValue, match="model name 'Llama 2' is not accepted"):
        create_job(session, owner=OWNER, model_name="Llama 2")
    assert create_job(session, owner=OWNER).model_name is None  # optional: registry users other than the quantizer


@pytest.mark.parametrize("limit", [0, -1, 10_001, True, 1.5])
def test_a_limit_out_of_range_is_refused(session: Session, limit: object) -> None:
    with pytest.raises(InvalidValue, match="job limit .* use an integer from 1 to 10000"):
        list_jobs(session, limit=limit)
