"""What every benchmark's figures carry and how they leave: the commit they were measured at
(STYLE.md: every figure names its machine, commit and command), and the report printed, the
JSON and the plot written the same way by each."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable


def git_commit() -> str:
    """The checkout's short commit, or "unknown" outside a git checkout (a copied tree)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out or "unknown"


def emit(res: dict, text: str, out: str | None, plot_path: str | None,
         plot: Callable[[dict, Path], Path]) -> None:
    """Print the report; write the figures as JSON to `out` and draw `plot` into `plot_path`
    when they are given."""
    print(text)
    if out:
        Path(out).write_text(json.dumps(res, indent=1))
    if plot_path:
        print(f"plot: {plot(res, Path(plot_path))}")
