"""Memory budgets and kernel-facing settings that cannot work are refused at start, in one line."""

import logging

import pytest
import torch

from services.worker import serving
from services.worker.config import ConfigError, WorkerConfig


def test_an_empty_memory_budget_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="''"):
        WorkerConfig.from_args(["--artifact", "a", "--gpu-memory-budget", ""])


def test_a_gpu_block_size_must_be_a_power_of_two():
    with pytest.raises(ConfigError, match="block_size=12 must be a power of two"):
        WorkerConfig(artifact="a", device="cuda", block_size=12)
    assert WorkerConfig(artifact="a", device="cuda", block_size=32).block_size == 32
    assert WorkerConfig(artifact="a", device="cpu", block_size=12).block_size == 12  # the reference runner pages any size


def _fake_gpu(monkeypatch, free, total):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


def test_a_budget_larger_than_the_gpu_is_refused(monkeypatch):
    _fake_gpu(monkeypatch, free=70 * 2**30, total=80 * 2**30)
    config = WorkerConfig(artifact="a", device="cuda", gpu_memory_budget=96 * 2**30)
    with pytest.raises(ConfigError, match="gpu-memory-budget 96.000 GiB is more than"):
        serving._budget(config, torch.device("cuda"))


def test_a_budget_beyond_the_free_memory_is_capped_with_a_warning(monkeypatch, caplog):
    _fake_gpu(monkeypatch, free=70 * 2**30, total=80 * 2**30)
    config = WorkerConfig(artifact="a", device="cuda", gpu_memory_budget=75 * 2**30)
    with caplog.at_level(logging.WARNING, logger=serving.__name__):
        assert serving._budget(config, torch.device("cuda")) == 70 * 2**30
    assert "free" in caplog.text
    within = WorkerConfig(artifact="a", device="cuda", gpu_memory_budget=48 * 2**30)
    assert serving._budget(within, torch.device("cuda")) == 48 * 2**30
    default = WorkerConfig(artifact="a", device="cuda")
    assert serving._budget(default, torch.device("cuda")) == int(70 * 2**30 * 0.9)


def test_running_out_of_device_memory_at_start_is_one_line(monkeypatch, capsys):
    from services.worker import server

    async def out_of_memory(config):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(server, "serve", out_of_memory)
    assert server.main(["--artifact", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: out of device memory while starting: CUDA out of memory") and "--kv-blocks" in err[-1]
