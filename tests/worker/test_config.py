"""WorkerConfig: parsed once from the command line, every bad setting named with what is accepted."""

import pytest

from services.worker.config import ConfigError, WorkerConfig, parse_bytes


def test_command_line_flags():
    cfg = WorkerConfig.from_args(
        ["--artifact", "0123", "--store", "/srv/store", "--device", "cuda:1", "--gpu-memory-budget", "48GiB",
         "--max-running-sequences", "64", "--max-waiting-requests", "9", "--max-batch-tokens", "1024",
         "--block-size", "32", "--port", "0", "--metrics-port", "-1", "--drain-grace-seconds", "2.5",
         "--gateway-address", "gw:50051", "--overlap-steps"],
        environ={"QSERVE_GATEWAY_TOKEN": "secret"},
    )
    assert cfg.gpu_memory_budget == 48 * 2**30 and cfg.device == "cuda:1" and cfg.block_size == 32
    assert (cfg.max_running_sequences, cfg.max_waiting_requests, cfg.max_batch_tokens) == (64, 9, 1024)
    assert cfg.metrics_port is None and cfg.port == 0 and cfg.drain_grace_s == 2.5
    assert cfg.store.kind == "local" and str(cfg.store.root) == "/srv/store"
    assert cfg.gateway_addresses == ("gw:50051",)
    assert cfg.gateway_token == "secret" and "secret" not in repr(cfg)
    assert cfg.overlap_steps is True
    assert WorkerConfig.from_args(["--artifact", "a", "--no-overlap-steps"]).overlap_steps is False
    assert WorkerConfig.from_args(["--artifact", "a"]).overlap_steps is None  # the device decides


def test_step_token_budget_defaults_by_device():
    """Large prefill steps on a GPU (a small one leaves the GPU waiting on the host's launches), small ones
    on the CPU backend; an explicit budget wins on either."""
    from services.worker.config import CPU_MAX_BATCH_TOKENS, GPU_MAX_BATCH_TOKENS

    assert CPU_MAX_BATCH_TOKENS < GPU_MAX_BATCH_TOKENS
    assert WorkerConfig.from_args(["--artifact", "a"]).max_batch_tokens == CPU_MAX_BATCH_TOKENS
    for device in ("cuda", "cuda:1"):
        assert WorkerConfig.from_args(["--artifact", "a", "--device", device]).max_batch_tokens == GPU_MAX_BATCH_TOKENS
        assert WorkerConfig(artifact="a", device=device, max_batch_tokens=256).max_batch_tokens == 256
    with pytest.raises(ConfigError, match="max_batch_tokens=0"):
        WorkerConfig(artifact="a", device="cuda", max_batch_tokens=0)


@pytest.mark.parametrize("text, value", [("48GiB", 48 * 2**30), ("512MiB", 512 * 2**20), ("2GB", 2 * 10**9),
                                         ("1.5GiB", int(1.5 * 2**30)), ("1000", 1000)])
def test_memory_sizes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"device": "tpu"}, ["'tpu'", "cpu, cuda, cuda:N"]),
        ({"format": "int3"}, ["'int3'", "w4a8kv4-g128"]),
        ({"block_size": 0}, ["block_size=0", "at least 1"]),
        ({"port": 70000}, ["port=70000", "0-65535"]),
        ({"gateway_addresses": ("gw:1",)}, ["gateway token"]),
        ({"gateway_addresses": ("nohostport",), "gateway_token": "t"}, ["'nohostport'", "host:port"]),
        ({"gateway_addresses": ("gw:1", "gw:0"), "gateway_token": "t"}, ["'gw:0'", "host:port"]),
        # gRPC targets of other forms were taken (shared.rpc.address: one rule for every service and qctl)
        ({"gateway_addresses": ("dns:///gw:50051",), "gateway_token": "t"}, ["'dns:///gw:50051'", "host:port"]),
        ({"advertise_address": "my host:50071"}, ["'my host:50071'", "host:port"]),
        ({"gateway_addresses": ("gw:1", "gw:1"), "gateway_token": "t"}, ["'gw:1'", "twice"]),
        ({"gateway_addresses": "gw:1", "gateway_token": "t"}, ["gateway_addresses", "'gw:1'", "sequence"]),
        ({"drain_grace_s": -1.0}, ["drain_grace_s=-1.0"]),
    ],
)
def test_bad_settings_are_named(overrides, words):
    with pytest.raises(ConfigError) as err:
        WorkerConfig(artifact="a", **overrides)
    for word in words:
        assert word in str(err.value)


def _gateways(*argv: str) -> tuple[str, ...]:
    args = ["--artifact", "a"]
    for value in argv:
        args += ["--gateway-address", value]
    return WorkerConfig.from_args(args, environ={"QSERVE_GATEWAY_TOKEN": "t"}).gateway_addresses


def test_several_gateways_by_repeating_the_flag_or_a_comma_separated_list():
    """One announcement per gateway replica, in the order given; the one token serves them all."""
    assert _gateways() == ()
    assert _gateways("gw-a:50051") == ("gw-a:50051",)
    assert _gateways("gw-a:50051", "gw-b:50051") == ("gw-a:50051", "gw-b:50051")
    assert _gateways("gw-a:50051,gw-b:50051", "10.0.0.3:7") == ("gw-a:50051", "gw-b:50051", "10.0.0.3:7")
    assert _gateways("gw-a:50051, gw-b:50051") == ("gw-a:50051", "gw-b:50051")
    with pytest.raises(ConfigError, match="gateway token"):
        WorkerConfig.from_args(["--artifact", "a", "--gateway-address", "gw-a:1,gw-b:1"], environ={})


@pytest.mark.parametrize(
    "argv, words",
    [
        (["gw-a:1", "gw-a:1"], ["'gw-a:1'", "twice"]),
        (["gw-a:1,gw-b:1", "gw-b:1"], ["'gw-b:1'", "twice"]),
        (["gw-a:1,GW-A:1"], ["'GW-A:1'", "twice"]),  # host names are case-insensitive
        (["gw-a:1,nohostport"], ["'nohostport'", "host:port"]),
        (["gw-a:1,,gw-b:1"], ["''", "host:port"]),
        (["gw-a:1,"], ["''", "host:port"]),
        ([""], ["''", "host:port"]),
        (["gw-a:http"], ["'gw-a:http'", "host:port"]),
        ([":50051"], ["':50051'", "host:port"]),
    ],
)
def test_duplicate_or_malformed_gateway_addresses_are_refused(argv, words):
    with pytest.raises(ConfigError) as err:
        _gateways(*argv)
    for word in words:
        assert word in str(err.value)


def test_bad_memory_size():
    with pytest.raises(ConfigError, match="'48 parsecs'"):
        parse_bytes("48 parsecs")


def test_a_step_budget_below_the_running_sequences_is_warned_about(caplog):
    """Decodes are served in admission order within the budget: the later sequences got no token until earlier
    ones finished, with nothing said (a stalled stream each)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="services.worker.config"):
        WorkerConfig(artifact="a", max_batch_tokens=8, max_running_sequences=32)
    assert any("max_batch_tokens=8 is below max_running_sequences=32" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.worker.config"):
        WorkerConfig(artifact="a", max_batch_tokens=32, max_running_sequences=32)
    assert not caplog.records
