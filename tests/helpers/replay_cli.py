"""What the replay's command-line tests share: a short replay's arguments, and running one that must be refused."""
from __future__ import annotations

import pytest

from canary.replay import cli

# A replay of a few requests on the reference backend: seconds, on any machine.
SHORT = ["replay", "--backend", "reference", "--max-requests", "6", "--max-batch-size", "4", "--chunk-size", "512"]


def refused(capsys, *argv: str) -> str:
    """Run ``kv-canary replay ARGV``, which must exit 2 with nothing on stdout; its last line of stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["replay", *argv])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == "", captured
    return captured.err.strip().splitlines()[-1]
