from __future__ import annotations

import pytest

from cairn.exceptions import ConfigError
from cairn.process.supervisor import RunSettings


def test_a_command_is_required() -> None:
    with pytest.raises(ConfigError, match="after --"):
        RunSettings(store="/tmp/s", key="k", argv=())
