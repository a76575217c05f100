"""Every service's --help works: it is what the compose file and the README point operators to."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_the_service_prints_its_help(service):
    result = subprocess.run([sys.executable, "-m", f"services.{service}.server", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "Traceback" not in result.stderr


class _RecordingEnv(dict):
    """An environment that remembers every variable a config parser asks for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


# Command lines that take every path through each parser that reads the environment.
ENV_ARGV = {
    "quantizer": ["--registry-url", "sqlite:////tmp/r.db", "--store", "s3://bucket"],
    "gateway": ["--registry-url", "sqlite:////tmp/r.db"],
    "worker": ["--artifact", "a", "--store", "s3://bucket", "--gateway-address", "gw:50051"],
}


def _help(service: str) -> str:
    import importlib

    return importlib.import_module(f"services.{service}.config")._parser().format_help()


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_the_help_names_every_environment_variable_the_service_reads(service):
    import importlib

    config = importlib.import_module(f"services.{service}.config")
    cls = {"quantizer": "QuantizerConfig", "gateway": "GatewayConfig", "worker": "WorkerConfig"}[service]
    env = _RecordingEnv(AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="s", QSERVE_GATEWAY_TOKEN="t")
    getattr(config, cls).from_args(ENV_ARGV[service], environ=env)
    # libpq reads PGPASSWORD itself: how a PostgreSQL registry's password stays off the command line.
    expected = env.asked | {"PGPASSWORD"}
    text = _help(service)
    assert not [name for name in sorted(expected) if name not in text], text


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_every_flag_has_help_text(service):
    import importlib

    parser = importlib.import_module(f"services.{service}.config")._parser()
    bare = [a.option_strings[0] for a in parser._actions if a.option_strings and not a.help]
    assert not bare, bare


def test_the_worker_help_says_how_to_name_several_gateway_replicas():
    """Each replica keeps its own worker pool: an operator must learn from --help to list every one."""
    from services.worker.config import _parser

    parser = _parser()
    action = next(a for a in parser._actions if "--gateway-address" in a.option_strings)
    assert "repeat" in action.help and "comma" in action.help and "QSERVE_GATEWAY_TOKEN" in action.help
