"""`python -m consumer` (under torchrun for more than one rank): serve a teacherq queue."""

from __future__ import annotations

import os
import sys


def main() -> int:
    """Read settings from the environment, configure logging, run the consumer."""
    from shared.log import configure_logging
    from shared.settings import SettingsError, load_settings

    try:
        settings = load_settings()
    except SettingsError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    configure_logging(
        level=settings.log.level, fmt=settings.log.format, rank=int(os.environ.get("RANK", 0))
    )
    from consumer.service import run

    return run(settings)


if __name__ == "__main__":
    sys.exit(main())
