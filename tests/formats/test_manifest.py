import json

import pytest

from shared.formats.manifest import Evaluation, FileEntry, Manifest, ManifestError


def _manifest(**kw):
    base = dict(
        artifact_id="a1" * 16, model_name="m", model_version="v" * 64, format="w4a8kv4-g128", gpu_target="sm90",
        quantizer_version="0.1.0", model_config={"hidden_size": 8}, options={"rotation": True},
        calibration={"data_name": "c.txt", "data_sha256": "0" * 64, "samples": 2, "seq_len": 16},
        created_at="2026-11-29T00:00:00+00:00",
    )
    base.update(kw)
    return Manifest(**base)


def test_round_trip_with_files_and_evaluation(tmp_path):
    m = _manifest(
        evaluation=Evaluation("eval.txt", "1" * 64, 512, 215, 5.01, 5.08),
        files=[FileEntry("weights/embed.safetensors", "2" * 64, 10)],
        kernel_policy={"(4096,4096)": {"1": "w4a8_fp8_small_m"}},
    )
    m.write(tmp_path)
    back = Manifest.read(tmp_path)
    assert back == m
    assert back.evaluation.ratio == pytest.approx(5.08 / 5.01)
    assert back.binding() == ("v" * 64, "w4a8kv4-g128", "sm90")


def test_unknown_format_and_gpu_are_refused_with_the_accepted_values():
    with pytest.raises(ManifestError, match="unknown format 'w3a8'.*w4a8kv4-g128"):
        _manifest(format="w3a8")
    with pytest.raises(ManifestError, match="unknown GPU target 'sm100'.*sm90"):
        _manifest(gpu_target="sm100")


@pytest.mark.parametrize("version", [99, True, 1.0, "1"])
def test_other_schema_versions_are_refused(tmp_path, version):
    """true and 1.0 equal 1 in Python: only the integer 1 is this schema."""
    d = json.loads(_manifest().to_json())
    d["schema_version"] = version
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ManifestError, match=f"schema_version {version!r}"):
        Manifest.read(tmp_path)


def test_a_manifest_that_is_not_utf8_is_a_manifest_error_naming_the_file(tmp_path):
    """It was the codec's words alone ("'utf-8' codec can't decode byte 0xff"), naming no file."""
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ManifestError, match=r"manifest.json is not UTF-8 text .*at byte 0"):
        Manifest.read(tmp_path)


def test_missing_manifest_says_not_an_artifact(tmp_path):
    with pytest.raises(ManifestError, match="not an artifact folder"):
        Manifest.read(tmp_path)


@pytest.mark.parametrize("edit", [
    lambda d: [d],  # not an object at all
    lambda d: {**d, "model_config": ["hidden_size", 8]},
    lambda d: {**d, "files": [{"path": "weights/embed.safetensors", "sha256": "2" * 64, "size": "10"}]},
    lambda d: {**d, "files": [{"path": None, "sha256": "2" * 64, "size": 10}]},
])
def test_a_manifest_of_the_wrong_shape_is_a_manifest_error(edit):
    """A worker refuses these with a clear error (ManifestError -> ArtifactCorrupt), not a crash."""
    d = json.loads(_manifest(files=[FileEntry("weights/embed.safetensors", "2" * 64, 10)]).to_json())
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(edit(d)))


@pytest.mark.parametrize("field, value", [
    # A number or a null was served: Info and the gateway registration then failed on every call (or registered '').
    ("artifact_id", 123),
    ("artifact_id", None),
    ("artifact_id", "a1"),  # not the quantizer's uuid4 hex, which names the cache folder and the registry row
    ("artifact_id", "A1" * 16),
    ("artifact_id", "a1" * 16 + "\n"),
    ("model_name", ["m"]),
    ("model_version", 1),
    ("quantizer_version", None),
    ("created_at", 20261129),
])
def test_an_identity_field_of_the_wrong_type_or_form_is_a_manifest_error(field, value):
    d = json.loads(_manifest().to_json())
    d[field] = value
    with pytest.raises(ManifestError, match=f"manifest {field} "):
        Manifest.from_json(json.dumps(d))
