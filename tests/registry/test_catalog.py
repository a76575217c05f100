from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from shared.registry import Conflict, InvalidValue, NotFound, get_model_version, register_model_version


def test_version_is_the_content_hash_with_a_label(session: Session) -> None:
    first = register_model_version(session, "tiny-llama", "c" * 64, label="v1")
    again = register_model_version(session, "tiny-llama", "c" * 64)
    assert again.id == first.id and again.label == "v1"
    assert get_model_version(session, "tiny-llama", "v1").id == first.id
    assert get_model_version(session, "tiny-llama", "c" * 64).id == first.id
    assert register_model_version(session, "tiny-llama", "d" * 64).label == "d" * 12


def test_labels_are_unique_within_a_model(session: Session) -> None:
    register_model_version(session, "tiny-llama", "c" * 64, label="v1")
    with pytest.raises(Conflict, match="label 'v1' of model 'tiny-llama' already names version 'c+'"):
        register_model_version(session, "tiny-llama", "d" * 64, label="v1")
    with pytest.raises(Conflict, match="already registered with label 'v1', not 'v2'"):
        register_model_version(session, "tiny-llama", "c" * 64, label="v2")
    assert register_model_version(session, "other-model", "d" * 64, label="v1").label == "v1"


def test_unknown_versions_and_bad_names_are_explained(session: Session) -> None:
    register_model_version(session, "tiny-llama", "c" * 64, label="v1")
    with pytest.raises(NotFound, match=r"no version with hash or label 'v9'; registered versions: v1 \(c+\)"):
        get_model_version(session, "tiny-llama", "v9")
    with pytest.raises(InvalidValue, match="model name 'meta-llama/Llama-3' is not accepted"):
        register_model_version(session, "meta-llama/Llama-3", "c" * 64)
