"""qctl jobs list / cancel against a running quantizer (the jobs are another quantizer's registry rows)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from qctl.main import app
from shared.registry import create_job, start_job
from shared.storage import StorageConfig

runner = CliRunner()
OTHER = "quantizer@elsewhere:1:boot"


def _run(*args: object) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "300"})
    return result.exit_code, result.stdout, result.stderr


def test_list_then_cancel_a_queued_and_a_running_job(tmp_path, start_quantizer, registry_url, open_registry):
    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url,
                                create_bucket=True)
    with open_registry(registry_url).transaction() as session:
        queued = create_job(session, owner=OTHER, model_name="llama").id
        running = create_job(session, owner=OTHER, model_name="llama").id
        start_job(session, running, owner=OTHER)
    address = ("--quantizer", quantizer.address)

    code, out, err = _run("jobs", "list", *address)
    assert code == 0, err
    assert queued in out and out.index(running) < out.index(queued)  # newest first

    code, out, err = _run("jobs", "cancel", queued, "--reason", "wrong checkpoint", "--by", "alice", *address)
    assert code == 0 and out.strip() == f"job {queued} cancelled: cancelled by alice: wrong checkpoint", err
    code, out, err = _run("jobs", "cancel", running, "--by", "alice", *address)
    assert code == 0 and f"job {running} is stopping" in out, err

    code, out, err = _run("jobs", "list", "--state", "cancelled", "--state", "running", "--json", *address)
    assert code == 0, err
    assert [(j["job_id"], j["state"], bool(j["cancel_requested_at"])) for j in json.loads(out)] == [
        (running, "RUNNING", True), (queued, "CANCELLED", True)]

    code, out, err = _run("jobs", "cancel", queued, *address)
    assert code == 2 and "has already ended: it is CANCELLED" in err and "(FAILED_PRECONDITION)" in err
