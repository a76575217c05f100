"""The issue-3 target lookup that bench/kernels.py and bench/gluon_g128.py both write their checks from."""

import pytest

from bench.kernels import fp16_target


@pytest.mark.parametrize("m, target", [(1, 3.0), (16, 3.0), (17, None), (32, None), (64, 2.5), (128, None),
                                       (256, 1.5), (1024, None), (4096, 1.5), (8192, None)])
def test_fp16_target_covers_exactly_the_issues_batch_sizes(m, target):
    assert fp16_target(m) == target
