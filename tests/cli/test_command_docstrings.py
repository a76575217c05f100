"""A command group's docstring names only the subcommands it has (deploy's named a `deploy show` that never was)."""

from __future__ import annotations

import re

import pytest

from qctl import deploy_cmd, jobs_cmd, rollout_cmd


@pytest.mark.parametrize("module", [deploy_cmd, rollout_cmd, jobs_cmd], ids=lambda m: m.__name__)
def test_the_docstring_names_the_groups_subcommands(module):
    named = re.match(r"`qctl \w+ ([\w|]+)`", module.__doc__)
    assert named, module.__doc__
    commands = {command.name for command in module.app.registered_commands}
    assert set(named.group(1).split("|")) == commands
