"""`teacherq serve`: an HTTP gateway that speaks the dialects trainers already call, on the queue.

A trainer written against slime's Megatron teacher server, SGLang's native `/generate`, vLLM's
OpenAI-compatible completions (and prime-rl's `/inference/v1/generate`) or TRL's `vllm-serve`
switches by changing its URL: every request becomes queue jobs (durable, batched with other
trainers' work, replayable, traced) and is answered in its engine's own shapes
(docs/gateway.md maps them field by field).

    server.py   the process: socket, lifecycle, drain on SIGTERM; assembles the routes
    core.py     what the dialects build on: job ids, the submit-and-wait path under a
                deadline, answers and errors in a dialect's shape, the consumers' state
    jobs.py     coalesced submits and the one completion reader every request waits on
    common.py   errors in each dialect's shape, body reading, field checks, JSON out
    generate.py POST /generate, shared by slime and SGLang: routed by the payload
    slime.py    slime's teacher server: /generate, /update_weights_from_disk, /get_loads...
    sglang.py   SGLang's /generate (input log-probs), /health_generate, /get_model_info
    vllm.py     /v1/completions, /v1/models, /inference/v1/generate
    trl.py      /get_sequence_logprobs/, /health/

Imports run one way: server -> generate.py and the dialects -> core -> jobs, common. A
dialect exposes `routes(gw)` and imports neither the server nor another dialect.
"""

from producer.gateway.server import Gateway, ListenError, serve

__all__ = ["Gateway", "ListenError", "serve"]
