"""docker-compose.yml: valid for docker-compose, and every service's command is one its code accepts."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from services.gateway.config import GatewayConfig
from services.quantizer.config import QuantizerConfig
from services.worker.config import WorkerConfig
from tests.conftest import REPO

CONFIGS = {
    "services.quantizer.server": QuantizerConfig,
    "services.gateway.server": GatewayConfig,
    "services.worker.server": WorkerConfig,
}
IDS = {"QSERVE_ARTIFACT_ID": "0123456789abcdef0123456789abcdef",
       "QSERVE_BASELINE_ARTIFACT_ID": "fedcba9876543210fedcba9876543210"}


@pytest.fixture(scope="module")
def compose() -> dict:
    """The file as docker-compose resolves it (anchors merged, variables interpolated)."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is not installed (Debian package docker-compose; scripts/test.sh installs it)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QSERVE_", "MINIO_", "POSTGRES_"))} | IDS
    result = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def _python_module(service: dict) -> str | None:
    command = service.get("command") or []
    return command[2] if command[:2] == ["python", "-m"] else None


def test_the_stack_has_every_part(compose):
    services = compose["services"]
    assert {"minio", "minio-init", "postgres", "quantizer", "gateway", "worker", "worker-baseline"} <= set(services)
    assert "mc mb --ignore-existing local/qserve-artifacts" in " ".join(services["minio-init"]["command"])
    for name in ("worker", "worker-baseline", "quantizer"):  # the quantizer's --device=auto finds it
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


@pytest.mark.parametrize("name", ["quantizer", "gateway", "worker", "worker-baseline"])
def test_each_service_command_parses_with_the_services_own_config(compose, name):
    service = compose["services"][name]
    module = _python_module(service)
    config = CONFIGS[module].from_args(service["command"][3:], environ=service.get("environment") or {})
    # The health check asks the port the service listens on.
    probe = service["healthcheck"]["test"]
    assert probe[:4] == ["CMD", "python", "-m", "shared.rpc.probe"]
    port = str(config.port) if isinstance(config, WorkerConfig) else config.listen.rpartition(":")[2]
    assert probe[4] == f"127.0.0.1:{port}"
    if isinstance(config, WorkerConfig):
        assert config.artifact in IDS.values() and config.device == "cuda"
        assert config.gateway_addresses == ("gateway:50051",) and config.gateway_token
        assert config.advertise_address == f"{name}:{port}"
    if isinstance(config, GatewayConfig):
        scopes = {token.scope for token in config.admin_tokens.values()}
        assert scopes == {"admin", "worker"}


def test_the_quantizer_requires_a_publish_token_from_the_environment(compose):
    """Without tokens anyone reaching port 50061 could publish models and cancel jobs."""
    quantizer = compose["services"]["quantizer"]
    assert "QSERVE_QUANTIZER_TOKENS" not in " ".join(quantizer["command"])
    tokens = QuantizerConfig.from_args(quantizer["command"][3:], environ=quantizer["environment"]).tokens
    assert {(name, t.token, t.scope) for name, t in tokens.items()} == {("ops", "change-me-quantizer", "publish")}
    header = (REPO / "docker-compose.yml").read_text().split("\nx-image", 1)[0]
    assert "QCTL_QUANTIZER_TOKEN" in header and "QSERVE_QUANTIZER_TOKEN" in header


def test_the_worker_token_is_one_the_gateway_accepts_for_workers(compose):
    gateway = compose["services"]["gateway"]
    tokens = GatewayConfig.from_args(gateway["command"][3:], environ=gateway["environment"]).admin_tokens
    worker_tokens = {t.token for t in tokens.values() if t.scope == "worker"}
    for name in ("worker", "worker-baseline"):
        assert compose["services"][name]["environment"]["QSERVE_GATEWAY_TOKEN"] in worker_tokens


@pytest.mark.parametrize("name", ["worker", "worker-baseline"])
def test_worker_downloads_and_compiled_kernels_survive_a_restart(compose, name):
    """Without a volume each restart downloads the artifact again and recompiles every kernel."""
    service = compose["services"][name]
    config = WorkerConfig.from_args(service["command"][3:], environ=service.get("environment") or {})
    # docker-compose v1 prints "source:target:mode", v2 a mapping
    mounts = {}
    for v in service.get("volumes", []):
        source, target = (v.split(":")[:2] if isinstance(v, str) else (v.get("source"), v["target"]))
        mounts[target] = source
    assert mounts.get("/data") in compose["volumes"], mounts  # a named volume, not the container's layer
    assert str(config.cache_dir).startswith("/data/")
    assert service["environment"]["TRITON_CACHE_DIR"].startswith("/data/")


def _copied_into_the_image(relative: str) -> bool:
    """Whether the Dockerfile's COPY instructions take `relative` (a path in the build context) into the image."""
    ignored = [line.strip().strip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    if any(relative == pattern or relative.startswith(pattern + "/") for pattern in ignored):
        return False
    for line in (REPO / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] != ["COPY"]:
            continue
        sources = [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
        if any(s == "." or relative == s or relative.startswith(s + "/") for s in sources):
            return True
    return False


def test_checkpoints_and_local_state_stay_out_of_the_image(compose):
    """The quantizer mounts ./models (checkpoints, gigabytes) from the build context, and `qctl up` writes
    .qserve-up/ (registry, artifacts) there: an image that copies them carries them to every host."""
    mounted = set()
    for service in compose["services"].values():
        for v in service.get("volumes", []):
            source = v.split(":")[0] if isinstance(v, str) else (v.get("source") if v.get("type") == "bind" else None)
            if source and source.startswith(str(REPO) + "/"):
                mounted.add(source[len(str(REPO)) + 1:])
    assert "models" in mounted, mounted
    for path in sorted(mounted | {".qserve-up"}):
        assert not _copied_into_the_image(f"{path}/llama/model.safetensors"), f"the image would contain {path}/"
    for needed in ("pyproject.toml", "setup.py", "README.md", "protos/qserve/v1/worker.proto",
                   "shared/registry/migrations/env.py", "services/worker/server.py", "qctl/main.py"):
        assert _copied_into_the_image(needed), f"the image needs {needed} to install the project"


def test_no_secret_is_on_a_compose_command_line():
    """A container's command line is what `ps`, `docker inspect` and `docker compose config` show: passwords
    and tokens go in its environment (the database password as PGPASSWORD, which libpq reads)."""
    binary = shutil.which("docker-compose")
    assert binary, "docker-compose is not installed (Debian package docker-compose; scripts/test.sh installs it)"
    secrets = {"POSTGRES_PASSWORD": "pg-s3cret", "MINIO_ROOT_PASSWORD": "minio-s3cret",
               "QSERVE_ADMIN_TOKEN": "admin-s3cret", "QSERVE_WORKER_TOKEN": "worker-s3cret"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QSERVE_", "MINIO_", "POSTGRES_"))}
    result = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config"], cwd=REPO,
                            env=env | IDS | secrets, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("quantizer", "gateway", "worker", "worker-baseline"):
        command = " ".join(services[name]["command"])
        assert not [s for s in secrets.values() if s in command], (name, command)
        registry = next(a for a in services[name]["command"] if a.startswith("--registry-url="))
        assert services[name]["environment"]["PGPASSWORD"] == "pg-s3cret" and "@postgres" in registry


def _seconds(period: str) -> float:
    """A compose duration as docker-compose config prints it (e.g. "45s", "1m30s")."""
    units, total, number = {"h": 3600, "m": 60, "s": 1}, 0.0, ""
    for char in period:
        if char.isdigit() or char == ".":
            number += char
        else:
            total, number = total + float(number) * units[char], ""
    return total


@pytest.mark.parametrize("name", ["quantizer", "gateway", "worker", "worker-baseline"])
def test_a_stop_gives_each_service_its_own_graceful_stop_time(compose, name):
    """docker stops a container with SIGTERM and kills it stop_grace_period later (10 s by default): a
    worker draining for 30 s after deregistering was killed mid-drain, its streams cut."""
    from services.worker.announce import DEREGISTER_TIMEOUT_S

    service = compose["services"][name]
    config = CONFIGS[_python_module(service)].from_args(service["command"][3:], environ=service.get("environment") or {})
    needed = config.drain_grace_s + DEREGISTER_TIMEOUT_S if isinstance(config, WorkerConfig) else config.grace_s
    assert _seconds(service.get("stop_grace_period", "10s")) >= needed + 5, \
        f"{name}: stop_grace_period {service.get('stop_grace_period', '10s (default)')} leaves no time after {needed} s"
