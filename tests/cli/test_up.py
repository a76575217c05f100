"""`qctl up --once`: the README's main job, end to end on loopback (quantizer, gateway, two CPU workers)."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from qctl.main import app
from shared.registry import create_registry, list_events, sqlite_url


def test_up_publishes_rolls_out_and_streams_through_the_gateway(tmp_path):
    workdir = tmp_path / "stack"
    result = CliRunner().invoke(app, ["up", "--workdir", str(workdir), "--once", "--new-tokens", "12",
                                      "--eval-windows", "2"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    err = result.stderr
    assert "no --model given: writing a small random-weight Llama" in err
    assert "fp16 artifact" in err and "w4a8kv4-g128 artifact" in err and "READY" in err
    assert "takes 20% as the canary" in err and "every key reached the same arm both times" in err
    assert "tokens from stable" in err and "12 tokens" in err
    assert result.stdout.startswith("def fibonacci(n):") and len(result.stdout) > len("def fibonacci(n):\n")

    # The rollout went through the registry: its events are there, in order.
    registry = create_registry(sqlite_url(workdir / "registry.db"))
    with registry.sessions() as session:
        kinds = [e.kind.value for e in list_events(session, deployment="demo")]
    assert kinds[:3] == ["deployment_create", "rollout_start", "promote"], kinds
    registry.close()


def test_up_names_a_model_folder_that_is_not_a_checkpoint(tmp_path):
    result = CliRunner().invoke(app, ["up", "--workdir", str(tmp_path / "s"), "--model", str(tmp_path), "--once"])
    assert result.exit_code == 2
    assert f"--model {tmp_path} has no config.json" in result.stderr


def test_up_runs_again_in_the_same_workdir(tmp_path):
    """`qctl up --once`, then `qctl up` again in the same --workdir (the default .qserve-up/): the second
    run finds the deployment the first left (quantized stable) and must still roll out and promote.

    It asks for another number of eval windows: the artifacts it reuses were evaluated on the first run's, and
    it printed those perplexities as its own check. It evaluates them again on its windows, and says so."""
    workdir = tmp_path / "stack"
    args = ["up", "--workdir", str(workdir), "--once", "--new-tokens", "4"]
    first = CliRunner().invoke(app, [*args, "--eval-windows", "1"], env={"COLUMNS": "200"})
    assert first.exit_code == 0, first.stderr
    second = CliRunner().invoke(app, [*args, "--eval-windows", "2"], env={"COLUMNS": "200"})
    assert second.exit_code == 0, second.stderr
    assert "takes 20% as the canary" in second.stderr and "is now stable" in second.stderr
    assert "tokens from stable" in second.stderr

    first_err, second_err = (" ".join(result.stderr.split()) for result in (first, second))
    checks = re.findall(r"(\S+) artifact \w+ READY: perplexity ([\d.]+) vs fp16 ([\d.]+) \([^)]*\) on (.+? tokens)",
                        first_err)
    assert [(fmt, on) for fmt, _, _, on in checks] == [("fp16", "eval, 1 window of 256 tokens"),
                                                       ("w4a8kv4-g128", "eval, 1 window of 256 tokens")], first_err
    again = ("published by an earlier run in this --workdir, was evaluated on eval, 1 window of 256 tokens: "
             "evaluating it again on eval, 2 windows of 256 tokens")
    assert second_err.count(again) == 2, second_err
    rechecks = re.findall(r"(\S+) artifact \w+ READY: perplexity ([\d.]+) vs fp16 ([\d.]+) \([^)]*\) on (.+? tokens)",
                          second_err)
    assert [(fmt, on) for fmt, _, _, on in rechecks] == [("fp16", "eval, 2 windows of 256 tokens"),
                                                         ("w4a8kv4-g128", "eval, 2 windows of 256 tokens")], second_err
    (_, fp16, fp16_ref, _), (_, quantized, quantized_ref, _) = rechecks
    assert fp16 == fp16_ref == quantized_ref != checks[0][1]  # one fp16 reference, measured on this run's windows

    registry = create_registry(sqlite_url(workdir / "registry.db"))
    with registry.sessions() as session:
        kinds = [e.kind.value for e in list_events(session, deployment="demo")]
    registry.close()
    assert kinds.count("deployment_create") == 1 and kinds.count("promote") >= 2, kinds


def test_a_worker_that_cannot_start_ends_up_with_one_line(tmp_path, monkeypatch):
    from qctl.stack import LocalStack
    from services.worker.errors import ArtifactCorrupt

    def refuse(self, artifact_id, memory_budget=None, timeout_s=300.0):
        raise ArtifactCorrupt(f"artifact {artifact_id} is corrupt: sha256 of weights/block_000.safetensors differs")

    monkeypatch.setattr(LocalStack, "start_worker", refuse)
    result = CliRunner().invoke(app, ["up", "--workdir", str(tmp_path / "s"), "--once", "--eval-windows", "1"])
    assert result.exit_code == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1].startswith("error: artifact ")



def test_a_worker_that_does_not_start_in_time_ends_up_with_one_line(tmp_path, monkeypatch):
    """A worker still loading at the deadline (a first GPU start compiles kernels for minutes; up waits 20 min
    there) is named in one line, not a concurrent.futures.TimeoutError traceback."""
    import concurrent.futures

    from qctl.stack import LocalStack

    def too_slow(self, artifact_id, memory_budget=None, timeout_s=300.0):
        assert timeout_s == 300.0  # the CPU's deadline
        raise concurrent.futures.TimeoutError()

    monkeypatch.setattr(LocalStack, "start_worker", too_slow)
    result = CliRunner().invoke(app, ["up", "--workdir", str(tmp_path / "s"), "--once", "--eval-windows", "1"])
    assert result.exit_code == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and last.startswith("error: the worker for ") and "did not start in 300 s" in last


def test_the_up_stack_quantizer_takes_only_its_generated_token(tmp_path):
    """`qctl up` matches what it does for the gateway: a generated token (scope publish), used by its own calls
    and printed in its `export` line; a call without it is refused."""
    import grpc

    from qctl.publish_cmd import quantizer_stub
    from qctl.stack import LocalStack
    from shared.rpc.qserve.v1 import quantizer_pb2

    stack = LocalStack(tmp_path, "cpu")
    try:
        address = stack.start_quantizer(tmp_path / "eval.txt")
        channel, stub = quantizer_stub(address, stack.quantizer_token)
        with channel:
            assert not stub.ListJobs(quantizer_pb2.ListJobsRequest(), timeout=30).jobs
        channel, stub = quantizer_stub(address)
        with channel:
            try:
                stub.ListJobs(quantizer_pb2.ListJobsRequest(), timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
            else:
                raise AssertionError("the stack's quantizer answered a call without its token")
    finally:
        stack.stop()


def test_the_commands_printed_for_another_shell_are_not_wrapped_at_the_terminals_width():
    """At 80 columns rich split the ~150-character export line in two: pasted, the second half's variables were
    not exported and qctl dialled its default quantizer."""
    import io

    from rich.console import Console

    from qctl.up_cmd import print_serving_help

    out = io.StringIO()
    print_serving_help(Console(file=out, width=80), "127.0.0.1:50051", "a" * 43, "127.0.0.1:50061", "q" * 43, "demo")
    (export,) = [line for line in out.getvalue().splitlines() if "export" in line]
    assert export.strip().startswith("export QCTL_GATEWAY=") and export.endswith("q" * 43)
