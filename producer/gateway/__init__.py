"""`teacherq serve`: an HTTP gateway that speaks the dialects trainers already call, on the queue.

A trainer written against slime's Megatron teacher server, SGLang's native `/generate`, vLLM's
OpenAI-compatible completions (and prime-rl's `/inference/v1/generate`) or TRL's `vllm-serve`
switches by changing its URL: every request becomes queue jobs (durable, batched with other
trainers' work, replayable, traced) and is answered in its engine's own shapes
(docs/gateway.md maps them field by field).

    server.py   the process: socket, aiohttp app, deadlines, drain on SIGTERM, served model
    jobs.py     coalesced submits and the one completion reader every request waits on
    common.py   errors in each dialect's shape, body reading, field checks, JSON out
    slime.py    slime's teacher server: /generate, /update_weights_from_disk, /get_loads...
    sglang.py   SGLang's /generate (input log-probs), /health_generate, /get_model_info
    vllm.py     /v1/completions, /v1/models, /inference/v1/generate
    trl.py      /get_sequence_logprobs/, /health/
"""

from producer.gateway.server import Gateway, ListenError, serve

__all__ = ["Gateway", "ListenError", "serve"]
