"""Every Redis name teacherq uses, in one place.

All keys of a queue carry the hash tag `{<queue>}` so they share one Redis Cluster slot and
multi-key operations (MULTI/EXEC, Lua) stay legal. The three stream names are public interface
(DESIGN.md); the rest are this code's choice.
"""

from __future__ import annotations

PREFIX = "teacherq"

# Stream entry field holding the job's token count, written by the submit script; acking an
# entry subtracts it from the queue's pending-token counter.
FIELD_TOKENS = "n_tokens"


def _q(queue: str) -> str:
    return f"{PREFIX}:{{{queue}}}"


def jobs_stream(queue: str) -> str:
    """Stream of submitted jobs, read by the consumer group."""
    return f"{_q(queue)}:jobs"


def done_stream(queue: str) -> str:
    """Stream of completion notices (job_id, status), read by waiting clients."""
    return f"{_q(queue)}:done"


def dead_stream(queue: str) -> str:
    """Dead-letter stream: jobs that failed for good, with reason and history."""
    return f"{_q(queue)}:dead"


def result_key(queue: str, job_id: str) -> str:
    """Hash holding one job's result record (inline arrays or object pointers)."""
    return f"{_q(queue)}:result:{job_id}"


def submitted_key(queue: str, job_id: str) -> str:
    """Marker set once per job id at submit (SET NX): makes resubmission a no-op."""
    return f"{_q(queue)}:submitted:{job_id}"


def pending_tokens_key(queue: str) -> str:
    """Counter of tokens submitted and not yet acknowledged (for backpressure)."""
    return f"{_q(queue)}:pending_tokens"


def replays_key(queue: str) -> str:
    """Hash job_id -> how often it was replayed from the dead-letter stream."""
    return f"{_q(queue)}:replays"


def weights_key(queue: str) -> str:
    """Hash describing the weights the queue should serve: path, generation, update state."""
    return f"{_q(queue)}:weights"


def replication_mark_key(queue: str) -> str:
    """String rewritten before each WAIT (redis.min_replicas_acked): a write of the queue's
    shard on the connection that then waits for replicas."""
    return f"{_q(queue)}:replication_mark"


def control_stream(queue: str) -> str:
    """Stream of commands every replica reads (weight updates), and their completions."""
    return f"{_q(queue)}:control"


def consumers_key(queue: str) -> str:
    """Hash consumer name -> JSON heartbeat record (state, layout, model version, time)."""
    return f"{_q(queue)}:consumers"


def model_key(queue: str) -> str:
    """Hash describing the model the consumers serve (vocab size, version)."""
    return f"{_q(queue)}:model"


def datasets_index_key(queue: str) -> str:
    """Sorted set of the queue's dataset ids, scored by creation time."""
    return f"{_q(queue)}:datasets"


def dataset_key(queue: str, dataset_id: str) -> str:
    """Hash: the dataset record (spec, state, timestamps, ingest progress)."""
    return f"{_q(queue)}:dataset:{dataset_id}"


def dataset_rejected_key(queue: str, dataset_id: str) -> str:
    """Hash row index -> reason, for the dataset's rows refused at ingest."""
    return f"{dataset_key(queue, dataset_id)}:rejected"


def dataset_finished_key(queue: str, dataset_id: str) -> str:
    """Bitmap: bit i set once the dataset's row i has a result record (ok or failed)."""
    return f"{dataset_key(queue, dataset_id)}:finished"


def dataset_failed_key(queue: str, dataset_id: str) -> str:
    """Bitmap: bit i set when the dataset's row i has a failed result."""
    return f"{dataset_key(queue, dataset_id)}:failed"


def dataset_rate_key(queue: str, dataset_id: str) -> str:
    """List of recent `[time, finished rows]` samples (newest first), for the dataset's ETA."""
    return f"{dataset_key(queue, dataset_id)}:rate"


def dataset_lease_key(queue: str, dataset_id: str) -> str:
    """Owner token of the one rq job working on the dataset, with a short TTL."""
    return f"{dataset_key(queue, dataset_id)}:lease"


# TTLs and limits.
SUBMITTED_TTL_S = 7 * 24 * 3600
DONE_STREAM_MAXLEN = 100_000  # completion notices are advisory: results live in result_key


# Traces and throughput (shared/trace_store.py, `teacherq trace` / `status`).
TRACE_TTL_S = 3 * 24 * 3600  # traces are for diagnosis, not an archive
TRACE_MAX_SPANS = 10_000  # per trace; the newest are kept
THROUGHPUT_MAXLEN = 100_000  # batch completion notices kept for `teacherq status`


def trace_key(queue: str, trace_id: str) -> str:
    """List of one trace's span records (JSON), oldest first."""
    return f"{_q(queue)}:trace:{trace_id}"


def job_trace_key(queue: str, job_id: str) -> str:
    """String: the trace id of a job."""
    return f"{_q(queue)}:trace_job:{job_id}"


def batch_trace_key(queue: str, batch_id: str) -> str:
    """String: the trace id of a batch (its own trace, shared by the jobs that rode in it)."""
    return f"{_q(queue)}:trace_batch:{batch_id}"


def trace_jobs_key(queue: str) -> str:
    """Sorted set job_id -> unix time of its first recorded span (for `--since/--until`)."""
    return f"{_q(queue)}:trace_jobs"


def throughput_stream(queue: str) -> str:
    """Capped stream, one entry per scored batch (fields jobs, tokens, consumer): tokens/s over
    a window is the sum over entries whose ids (ms timestamps) fall in it."""
    return f"{_q(queue)}:throughput"
