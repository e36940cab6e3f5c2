"""The forward room: the model and its forward (spec, attention, MLA, MoE, scoring, pipeline
stages, CUDA graphs, prompt sharing, the batch's tensors).

Imports only the floors (consumer/tp_ops, consumer/kernels and the top-level modules), never
group, serve or checkpoints (tests/unit/test_rooms.py).
"""
