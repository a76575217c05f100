"""The launchers' host-side cdiv / next_power_of_2 give Triton's answers."""

import triton

from services.worker.kernels.host_int import cdiv, next_power_of_2


def test_host_helpers_match_triton():
    for n in range(0, 1100):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(2**40 + 1) == 2**41
