"""Exit codes teacherq processes use where a supervisor must tell them apart.

A placeholder until the one exit-code table of the CLI (issue #20) lands; it keeps the same
name and value for the configuration code.

- 78 (`CONFIG`, sysexits EX_CONFIG): the settings or the Redis server's configuration are
  wrong (e.g. AOF off, an eviction policy); restarting cannot help, so supervisors should not
  restart on it (systemd `RestartPreventExitStatus=78`; see docs/operations.md).
"""

from __future__ import annotations

CONFIG = 78  # sysexits EX_CONFIG
EXIT_CONFIG = CONFIG
