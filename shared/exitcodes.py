"""Exit codes of every teacherq command (the `teacherq` verbs and `python -m consumer`).

One table, so scripts and supervisors can tell "fix your input" from "retry later" from "a bug":

| code | name | meaning |
| --- | --- | --- |
| 0 | OK | done |
| 1 | FAILED | the work ran and failed: a job, a dataset or a weight update failed |
| 2 | USAGE | bad input: an argument, an input file's line, an unknown job id, a checkpoint path |
| 3 | NOT_DONE | not finished yet: a `--wait` timed out, or results asked for are still pending |
| 5 | BUSY | refused for now: another weight update runs, or the queue is full |
| 69 | UNAVAILABLE | a service (Redis, object storage) cannot be reached |
| 70 | INTERNAL | an unexpected error (a bug): run again with `--debug` for the traceback |
| 78 | CONFIG | the settings are wrong: a `TEACHERQ_*` variable or the `TEACHERQ_CONFIG` file |
| 130 | INTERRUPTED | stopped by Ctrl-C |
"""

from __future__ import annotations

OK = 0
FAILED = 1
USAGE = 2
NOT_DONE = 3
BUSY = 5
UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE
INTERNAL = 70  # sysexits EX_SOFTWARE
CONFIG = 78  # sysexits EX_CONFIG
INTERRUPTED = 130

SUMMARY = (
    "0 ok, 1 failed (a job, dataset or weight update), 2 bad input, 3 not done yet "
    "(--wait timed out or still pending), 5 busy (another update runs, queue full), "
    "69 Redis/storage unreachable, 70 internal error (rerun with --debug), "
    "78 bad settings or config file, 130 interrupted."
)
