"""GPU side of teacherq: parallel layout, Megatron model, TP head math, the worker loop."""
