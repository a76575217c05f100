"""How an operator configures the three services: every bad setting is one line naming it and exit code 2
(never a traceback, never a silent default), secrets stay out of messages and command lines, and the same
concept is spelled and read the same way in every service."""

from __future__ import annotations

import importlib

import pytest

from services.gateway.config import GatewayConfig
from services.quantizer.config import QuantizerConfig
from services.worker.config import WorkerConfig
from shared.config import nonempty_path
from tests.tls.certs import Certs, make_certs

CONFIGS = {"quantizer": QuantizerConfig, "gateway": GatewayConfig, "worker": WorkerConfig}
SECRET = "hunter2-s3cret"
ARTIFACT_ID = "0123456789abcdef0123456789abcdef"


def _base(service: str, tmp_path) -> list[str]:
    """The least a service's command line needs, pointing at throwaway places."""
    registry = f"sqlite:///{tmp_path}/registry.db"
    return {"quantizer": ["--registry-url", registry, "--store", str(tmp_path / "store")],
            "gateway": ["--registry-url", registry],
            "worker": ["--artifact", ARTIFACT_ID, "--port", "0", "--metrics-port", "-1"]}[service]


def _refusal(service: str, argv: list[str], capsys, environ: dict | None = None) -> str:
    """Parses argv as the service's main() would, expecting a refusal: returns its one line."""
    module = importlib.import_module(f"services.{service}.config")
    try:
        config = CONFIGS[service].from_args(argv, environ=environ or {})
    except SystemExit as exc:  # argparse's usage errors
        assert exc.code == 2
        message = capsys.readouterr().err
    except module.ConfigError as exc:  # main() prints "error: <message>" and returns 2
        message = f"error: {exc}"
    else:
        pytest.fail(f"{service} accepted {argv}: {config!r}")
    assert "Traceback" not in message
    assert message.strip().count("\n") == 0, f"not one line:\n{message}"
    return message.strip()


def _main(service: str, argv: list[str], capsys) -> tuple[int, str]:
    """Runs the service's main(argv) in this process: its exit code and stderr without log lines."""
    main = importlib.import_module(f"services.{service}.server").main
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    return code, "\n".join(line for line in err.splitlines() if " INFO " not in line)


@pytest.mark.parametrize("service, flag, value", [("quantizer", "--workers", "abc"),
                                                  ("gateway", "--fallback-min-requests", "1.5"),
                                                  ("worker", "--max-batch-tokens", "lots")])
def test_a_value_of_the_wrong_type_is_one_line_naming_the_flag(service, flag, value, tmp_path, capsys):
    # argparse's own message comes after a usage block of 15+ lines that buries it.
    message = _refusal(service, [*_base(service, tmp_path), flag, value], capsys)
    assert message.startswith("error: ") and flag in message and repr(value) in message


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_an_unknown_or_abbreviated_flag_is_refused(service, tmp_path, capsys):
    assert "--no-such-flag" in _refusal(service, [*_base(service, tmp_path), "--no-such-flag", "1"], capsys)
    # An abbreviation parses today and breaks the day a flag with the same prefix is added.
    assert "--grac" in _refusal(service, [*_base(service, tmp_path), "--grac", "1"], capsys)


@pytest.mark.parametrize("service, flag", [("quantizer", "--store"), ("quantizer", "--work-dir"),
                                           ("quantizer", "--eval-data"), ("quantizer", "--calib-data"),
                                           ("quantizer", "--registry-url"), ("gateway", "--listen"),
                                           ("worker", "--host"), ("worker", "--cache-dir"), ("worker", "--store"),
                                           ("worker", "--registry-url")])
def test_an_empty_value_is_refused_not_taken_for_a_default(service, flag, tmp_path, capsys):
    """`--store=${UNSET_VARIABLE:-}` in a compose file: the quantizer served the current directory as its
    store, the worker bound --host '' to every interface and took --store '' for no store."""
    message = _refusal(service, [*_base(service, tmp_path), f"{flag}="], capsys)
    assert flag in message and "empty" in message


@pytest.mark.parametrize("flag, value", [("--orphan-after-s", "nan"), ("--grace-s", "inf"), ("--heartbeat-s", "nan"),
                                         ("--grace-s", "nan")])
def test_the_quantizer_refuses_non_finite_durations(flag, value, tmp_path, capsys):
    message = _refusal("quantizer", [*_base("quantizer", tmp_path), flag, value], capsys)
    assert flag.lstrip("-").replace("-", "_") in message and value in message


def test_the_tpot_budget_error_names_the_flag_and_its_unit(tmp_path, capsys):
    # It said "max TPOT p95 -0.005 must be a positive number of seconds" for --max-tpot-p95-ms -5.
    message = _refusal("gateway", [*_base("gateway", tmp_path), "--max-tpot-p95-ms", "-5"], capsys)
    assert "--max-tpot-p95-ms" in message and "-5" in message and "milliseconds" in message
    message = _refusal("gateway", [*_base("gateway", tmp_path), "--max-ttft-p95-ms", "-5"], capsys)
    assert "--max-ttft-p95-ms" in message and "-5" in message and "or 0 (not judged)" in message


@pytest.mark.parametrize("service", ["gateway", "worker"])
def test_metrics_port_minus_one_turns_metrics_off_in_every_service(service, tmp_path):
    argv = [a for a in _base(service, tmp_path) if a not in ("--metrics-port", "-1")]
    assert CONFIGS[service].from_args([*argv, "--metrics-port", "-1"], environ={}).metrics_port is None
    assert CONFIGS[service].from_args([*argv, "--metrics-port", "0"], environ={}).metrics_port == 0


def test_the_gateway_serves_metrics_on_its_listen_host(tmp_path):
    """Like the worker (--host): a gateway told to listen on loopback does not expose /metrics on every
    interface."""
    base = [*_base("gateway", tmp_path), "--metrics-port", "0"]
    assert GatewayConfig.from_args(base, environ={}).metrics_host == "127.0.0.1"
    assert GatewayConfig.from_args([*base, "--listen", "0.0.0.0:50051"], environ={}).metrics_host == "0.0.0.0"


@pytest.mark.parametrize("service", ["quantizer", "worker"])
@pytest.mark.parametrize("query, flag", [("endpoint=http://a:9000", ["--store-endpoint", "http://b:9000"]),
                                         ("region=eu-west-1", ["--store-region", "us-west-2"])])
def test_a_store_setting_given_twice_is_refused(service, query, flag, tmp_path, capsys):
    # The URL's value won silently over the flag's.
    argv = [*_base(service, tmp_path), "--store", f"s3://bucket?{query}", *flag]
    message = _refusal(service, argv, capsys)
    assert flag[0] in message and "--store" in message


@pytest.mark.parametrize("service", ["quantizer", "worker"])
def test_credentials_in_a_store_url_are_not_echoed(service, tmp_path, capsys):
    message = _refusal(service, [*_base(service, tmp_path), "--store", f"s3://admin:{SECRET}@bucket/x"], capsys)
    assert "credentials" in message and SECRET not in message


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
@pytest.mark.parametrize("url", [f"postgresql+psycopg://qserve:{SECRET}@db:5432/qserve",
                                 f"postgresql+psycopg://qserve@db:5432/qserve?password={SECRET}"])
def test_a_registry_url_carrying_a_password_is_refused_unechoed(service, url, tmp_path, capsys):
    """Accepted and used, though its help said the password comes from $PGPASSWORD: it sat in `ps` (security
    audit)."""
    argv = [arg for arg in _base(service, tmp_path)]
    argv = argv[2:] if argv[0] == "--registry-url" else argv
    message = _refusal(service, [*argv, "--registry-url", url], capsys)
    assert "PGPASSWORD" in message and SECRET not in message


def test_a_store_url_with_credentials_and_a_hash_is_not_echoed(tmp_path, capsys):
    message = _refusal("quantizer", [*_base("quantizer", tmp_path)[:2], "--store", f"s3://admin:{SECRET}@b/x#y"],
                       capsys)
    assert "'#'" in message and SECRET not in message


def test_secrets_are_not_in_a_config_repr(tmp_path):
    """A config object that ends up in a log line or a test failure must not carry a secret with it."""
    registry = "postgresql+psycopg://qserve@db:5432/qserve"  # one carrying a password is refused (test above)
    env = {"QSERVE_ADMIN_TOKENS": f"ops={SECRET}-a:admin,w={SECRET}-w:worker", "QSERVE_API_KEYS": f"{SECRET}-k",
           "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": SECRET, "QSERVE_GATEWAY_TOKEN": SECRET,
           "QSERVE_QUANTIZER_TOKENS": f"ci={SECRET}-q:publish"}
    configs = [
        QuantizerConfig.from_args(["--registry-url", registry, "--store", "s3://bucket"], environ=env),
        GatewayConfig.from_args(["--registry-url", registry], environ=env),
        WorkerConfig.from_args(["--artifact", ARTIFACT_ID, "--registry-url", registry, "--store", "s3://bucket",
                                "--gateway-address", "gw:50051"], environ=env),
    ]
    for config in configs:
        assert SECRET not in repr(config), repr(config)


def test_the_quantizer_reads_scoped_caller_tokens_from_its_environment(tmp_path):
    config = QuantizerConfig.from_args(_base("quantizer", tmp_path),
                                       environ={"QSERVE_QUANTIZER_TOKENS": " ci = a:b:publish , dash=xyz:read "})
    assert {name: (t.token, t.scope) for name, t in config.tokens.items()} == {"ci": ("a:b", "publish"),
                                                                                "dash": ("xyz", "read")}
    assert QuantizerConfig.from_args(_base("quantizer", tmp_path), environ={}).tokens == {}  # off: as before
    assert QuantizerConfig.from_args(_base("quantizer", tmp_path),
                                     environ={"QSERVE_QUANTIZER_TOKENS": " , "}).tokens == {}


@pytest.mark.parametrize("value, expected", [
    (f"ci={SECRET}", "entry ci=... is not name=token:scope"),  # no scope: the token must not be echoed
    (f"{SECRET}", "entry (no '=') is not name=token:scope"),
    (f"={SECRET}:publish", "is not name=token:scope"),
    ("ci=:publish", "is not name=token:scope"),
    (f"ci={SECRET}:admin", "token 'ci' has scope 'admin'; accepted scopes: publish, read"),
    (f"ci={SECRET}:publish,ci={SECRET}-2:read", "token name 'ci' appears twice"),
    (f"ci={SECRET}:publish,dash={SECRET}:read", "token 'dash' reuses another name's token"),
    (f"{'n' * 129}={SECRET}:read", "at most 128 are accepted"),
])
def test_a_bad_quantizer_token_setting_is_one_line_naming_it(value, expected, tmp_path, capsys):
    message = _refusal("quantizer", _base("quantizer", tmp_path), capsys,
                       environ={"QSERVE_QUANTIZER_TOKENS": value})
    assert message.startswith("error: QSERVE_QUANTIZER_TOKENS: ") and expected in message, message
    assert SECRET not in message


def test_an_admin_token_name_longer_than_an_event_actor_is_refused_at_start_up(tmp_path, capsys):
    """The name is recorded as the actor of each change the token makes: refused at start-up, not at the
    token's first change."""
    message = _refusal("gateway", _base("gateway", tmp_path), capsys,
                       environ={"QSERVE_ADMIN_TOKENS": f"{'n' * 129}={SECRET}:admin"})
    assert message.startswith("error: QSERVE_ADMIN_TOKENS: ") and "at most 128 are accepted" in message, message
    assert SECRET not in message


def test_no_service_takes_a_secret_on_its_command_line():
    """A command line is visible to every user of the host (ps, /proc, docker inspect): tokens, keys and
    passwords come from the environment, in every service alike."""
    for service in CONFIGS:
        parser = importlib.import_module(f"services.{service}.config")._parser()
        # --tls-key and --tls-client-key name a file: the key itself stays there, readable by the service only.
        flags = [s for a in parser._actions for s in a.option_strings if not _names_a_file(a)]
        # By word: --max-batch-tokens counts tokens, --gateway-token would carry one.
        leaking = [f for f in flags if {"token", "secret", "password", "key"} & set(f.lstrip("-").split("-"))]
        assert not leaking, (service, leaking)


def _names_a_file(action) -> bool:
    return action.metavar == "FILE" and action.type in (None, nonempty_path)


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_a_registry_that_cannot_be_reached_is_one_line(service, tmp_path, capsys):
    # SQLAlchemy's message is three lines; the worker's main let it out as a traceback.
    err = _start_with_registry(service, tmp_path, capsys, "postgresql+psycopg://qserve@127.0.0.1:1/qserve")
    assert "127.0.0.1" in err


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_a_registry_path_that_cannot_be_created_is_one_line(service, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _start_with_registry(service, tmp_path, capsys, f"sqlite:///{blocker}/registry.db")
    assert str(blocker) in err


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_a_registry_url_with_a_port_that_is_not_a_number_is_one_line(service, tmp_path, capsys):
    err = _start_with_registry(service, tmp_path, capsys, f"postgresql+psycopg://qserve:{SECRET}@db:notaport/qserve")
    assert "the registry URL cannot be parsed" in err and SECRET not in err  # was int()'s traceback


@pytest.mark.parametrize("service", ["quantizer", "worker"])
def test_a_cuda_device_this_process_cannot_see_stops_the_service_at_start(service, tmp_path, capsys, monkeypatch):
    """The worker's first load raised a traceback; the quantizer reported healthy and failed every publish."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _main(service, [*_base(service, tmp_path), "--device", "cuda"], capsys)
    assert code == 2 and err == "error: --device cuda: no CUDA GPU is visible to this process (a CPU build of " \
                                "torch, or no GPU); use --device cpu", err
    for bad in ("cuda:", "cuda:x"):  # the quantizer took these, and failed every publish on them
        assert f"device {bad!r} is not supported" in _refusal(service, [*_base(service, tmp_path), "--device", bad],
                                                                capsys)


def test_a_kv_cache_the_hosts_memory_cannot_hold_is_one_line(tmp_path, capsys, monkeypatch):
    """On the CPU a --kv-blocks past the host's memory failed in torch's allocator: a traceback."""
    from services.worker import server

    async def serve(config):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1717986918400 bytes.")

    monkeypatch.setattr(server, "serve", serve)
    code, err = _main("worker", [*_base("worker", tmp_path), "--kv-blocks", "100000000"], capsys)
    assert code == 2 and err.startswith("error: out of host memory while starting: ") and "--kv-blocks" in err, err


def _start_with_registry(service, tmp_path, capsys, registry_url: str) -> str:
    """Starts `service` on a registry it cannot open; asserts one error line and exit code 2, returns it."""
    argv = [*_base(service, tmp_path), "--registry-url", registry_url]
    if service == "worker":
        argv += ["--store", str(tmp_path)]
    else:
        (tmp_path / "store").mkdir()
    code, err = _main(service, argv, capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 0, err
    return err



def _readme_commands() -> list[list[str]]:
    """The `python -m services.<name>.server ...` lines of the README, continuations joined."""
    import shlex

    from tests.conftest import REPO

    text = (REPO / "README.md").read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.startswith("python -m services."):
            words = shlex.split(line.partition("#")[0].replace("&", ""))
            commands.append([ARTIFACT_ID if w == "<id>" else w for w in words])
    return commands


def test_the_readme_service_commands_parse():
    commands = _readme_commands()
    assert {c[2] for c in commands} == {f"services.{s}.server" for s in CONFIGS}
    for command in commands:
        service = command[2].split(".")[1]
        config = CONFIGS[service].from_args(command[3:], environ={"QSERVE_GATEWAY_TOKEN": "W"})
        if service == "quantizer" and config.store.kind == "local":
            # On a fresh machine the folder does not exist yet: without --create-bucket the quantizer stops.
            assert config.create_bucket, command


# ------------------------------------------------------------------------------------------------ TLS

@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


def _pem_files(tmp_path):
    not_pem = tmp_path / "notes.txt"
    not_pem.write_text("a certificate will go here\n")
    encrypted = tmp_path / "encrypted-key.pem"
    encrypted.write_text("-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n")
    return not_pem, encrypted


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_tls_serving_takes_a_certificate_and_its_key_checked_at_start_up(service, tmp_path, certs, capsys):
    base = _base(service, tmp_path)
    not_pem, encrypted = _pem_files(tmp_path)
    missing = tmp_path / "missing.pem"
    config = CONFIGS[service].from_args([*base, "--tls-cert", str(certs.server_cert), "--tls-key",
                                         str(certs.server_key)], environ={})
    assert config.tls is not None and config.tls.client_ca is None
    assert b"PRIVATE KEY" not in repr(config).encode() and "PRIVATE KEY" not in repr(config.tls)
    assert CONFIGS[service].from_args(base, environ={}).tls is None  # off unless asked for
    mutual = CONFIGS[service].from_args([*base, "--tls-cert", str(certs.server_cert), "--tls-key",
                                         str(certs.server_key), "--tls-client-ca", str(certs.ca)], environ={})
    assert mutual.tls.client_ca == certs.ca.read_bytes()

    refusals = [  # (argv, what the one line must say)
        (["--tls-cert", str(certs.server_cert)], "--tls-cert and --tls-key go together"),
        (["--tls-key", str(certs.server_key)], "--tls-cert and --tls-key go together"),
        (["--tls-client-ca", str(certs.ca)], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["--tls-cert", str(missing), "--tls-key", str(certs.server_key)], f"--tls-cert {missing}: cannot read it"),
        (["--tls-cert", str(not_pem), "--tls-key", str(certs.server_key)],
         f"--tls-cert {not_pem} holds no PEM certificate"),
        (["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.ca)],
         f"--tls-key {certs.ca} holds no PEM private key"),
        (["--tls-cert", str(certs.server_cert), "--tls-key", str(encrypted)], "is an encrypted key"),
        (["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.client_key)],
         f"--tls-key {certs.client_key} is not the private key of the certificate in --tls-cert {certs.server_cert}"),
        (["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key), "--tls-client-ca", str(not_pem)],
         f"--tls-client-ca {not_pem} holds no PEM certificate"),
        (["--tls-cert="], "--tls-cert: must not be empty"),
    ]
    for argv, says in refusals:
        message = _refusal(service, [*base, *argv], capsys)
        assert says in message, (argv, message)


@pytest.mark.parametrize("service", ["gateway", "worker"])
def test_tls_towards_peers_is_on_with_a_ca_and_off_without(service, tmp_path, certs, capsys):
    """The gateway dials workers, the worker dials gateways: --tls-ca (empty: plaintext, as from an unset
    compose variable), a client certificate for mutual TLS, refused one line at a time when it cannot work."""
    field = {"gateway": "worker_tls", "worker": "gateway_tls"}[service]
    base = _base(service, tmp_path)
    not_pem, _ = _pem_files(tmp_path)
    assert getattr(CONFIGS[service].from_args([*base, "--tls-ca="], environ={}), field) is None
    client = getattr(CONFIGS[service].from_args(
        [*base, "--tls-ca", str(certs.ca), "--tls-client-cert", str(certs.client_cert), "--tls-client-key",
         str(certs.client_key)], environ={}), field)
    assert client.ca == certs.ca.read_bytes() and client.cert_chain == certs.client_cert.read_bytes()
    refusals = [
        (["--tls-client-cert", str(certs.client_cert), "--tls-client-key", str(certs.client_key)],
         "--tls-client-cert needs --tls-ca"),
        (["--tls-ca", str(certs.ca), "--tls-client-cert", str(certs.client_cert)],
         "--tls-client-cert and --tls-client-key go together"),
        (["--tls-ca", str(not_pem)], f"--tls-ca {not_pem} holds no PEM certificate"),
        (["--tls-ca", str(tmp_path)], f"--tls-ca {tmp_path}: cannot read it"),
    ]
    for argv, says in refusals:
        message = _refusal(service, [*base, *argv], capsys)
        assert says in message, (argv, message)


@pytest.mark.parametrize("service", ["quantizer", "gateway", "worker"])
def test_a_tls_file_that_cannot_be_used_stops_the_service_with_exit_code_2(service, tmp_path, certs, capsys):
    missing = tmp_path / "missing-key.pem"
    code, err = _main(service, [*_base(service, tmp_path), "--tls-cert", str(certs.server_cert), "--tls-key",
                                str(missing)], capsys)
    assert code == 2 and err.startswith("error: --tls-key") and str(missing) in err and err.count("\n") == 0, err
