"""Per-second arm reports of gateway replicas (shared/registry/arm_reports.py), on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from shared.registry import ArmSecond, InvalidValue, Registry, fleet_arm_totals, purge_arm_reports, write_arm_seconds
from shared.registry.arm_reports import tpot_step, ttft_step
from shared.registry.models import ArmReport


def test_reports_sum_over_replicas_and_seconds_without_the_readers_own(registry: Registry) -> None:
    with registry.transaction() as session:
        write_arm_seconds(session, "a" * 32, [ArmSecond("chat", "c1", 100, 5, 1, {tpot_step(0.02): 4}),
                                              ArmSecond("chat", "c1", 101, 3, 3, {}),
                                              ArmSecond("chat", "s1", 100, 7, 0, {tpot_step(0.01): 7})])
        write_arm_seconds(session, "b" * 32, [ArmSecond("chat", "c1", 100, 2, 0, {tpot_step(0.02): 1,
                                                                                  tpot_step(0.5): 1}),
                                              ArmSecond("chat", "c1", 99, 9, 9, {})])  # before the window
    with registry.sessions() as session:
        totals = fleet_arm_totals(session, "chat", "c1", 100, 101)
        assert (totals.requests, totals.errors) == (10, 4)
        assert totals.tpot_counts == {200: 5, 5000: 1}  # tenths of a millisecond
        mine_excluded = fleet_arm_totals(session, "chat", "c1", 100, 101, exclude_gateway="a" * 32)
        assert (mine_excluded.requests, mine_excluded.errors) == (2, 0)
        assert fleet_arm_totals(session, "chat", "c1", 102, 200).requests == 0


def test_a_second_written_again_replaces_the_first_and_old_seconds_are_purged(registry: Registry) -> None:
    with registry.transaction() as session:
        write_arm_seconds(session, "a" * 32, [ArmSecond("chat", "c1", 100, 5, 1)])
    with registry.transaction() as session:  # a retry after a commit whose reply was lost
        write_arm_seconds(session, "a" * 32, [ArmSecond("chat", "c1", 100, 6, 2), ArmSecond("chat", "c1", 200, 1, 0)])
    with registry.sessions() as session:
        assert fleet_arm_totals(session, "chat", "c1", 0, 1000).requests == 7
    with registry.transaction() as session:
        assert purge_arm_reports(session, 150) == 1
    with registry.sessions() as session:
        assert fleet_arm_totals(session, "chat", "c1", 0, 1000).requests == 1


def test_a_report_with_impossible_counts_is_refused(registry: Registry) -> None:
    with pytest.raises(InvalidValue, match="errors <= requests"), registry.transaction() as session:
        write_arm_seconds(session, "a" * 32, [ArmSecond("chat", "c1", 100, 1, 2)])


def test_times_to_the_first_token_sum_too_and_reports_from_before_them_hold_none(registry: Registry) -> None:
    with registry.transaction() as session:
        write_arm_seconds(session, "a" * 32, [ArmSecond("chat", "c1", 100, 3, 0, {}, {ttft_step(0.25): 3})])
        write_arm_seconds(session, "b" * 32, [ArmSecond("chat", "c1", 100, 2, 0, {}, {ttft_step(0.25): 1,
                                                                                      ttft_step(2.0): 1})])
        # a replica that ran before migration 0005 wrote no times to the first token
        session.execute(sa.update(ArmReport).where(ArmReport.gateway_id == "b" * 32).values(ttft_counts=None))
        write_arm_seconds(session, "c" * 32, [ArmSecond("chat", "c1", 101, 1, 0, {}, {ttft_step(0.0404): 1})])
    with registry.sessions() as session:
        totals = fleet_arm_totals(session, "chat", "c1", 100, 101)
        assert totals.requests == 6 and totals.ttft_counts == {250: 3, 40: 1}  # milliseconds
