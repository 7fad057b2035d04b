"""Restart backoff arithmetic (pure)."""

import pytest
from shoal.operator.backoff import restart_delay, restarts_exhausted


@pytest.mark.parametrize(
    "restarts, base, cap, delay",
    [(0, 10, 300, 0), (1, 10, 300, 10), (2, 10, 300, 20), (3, 10, 300, 40), (6, 10, 300, 300),
     (200, 10, 300, 300), (3, 0, 300, 0), (1, 5, 2, 2)],
)
def test_delay_doubles_from_base_up_to_the_cap(restarts, base, cap, delay):
    assert restart_delay(restarts, base, cap) == delay


@pytest.mark.parametrize(
    "restarts, limit, done", [(0, 3, False), (2, 3, False), (3, 3, True), (1000, 0, False)]
)
def test_max_restarts_zero_means_unlimited(restarts, limit, done):
    assert restarts_exhausted(restarts, limit) is done
