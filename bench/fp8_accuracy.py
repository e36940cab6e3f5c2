"""FP8 log-prob accuracy: teacherq's FP8 path and transformers' own, each against the exact
dequantized weights run in bf16 (issue 50).

A random-init checkpoint of a shape (a Qwen3-8B cut, or a DeepSeek-V3 cut with fewer routed
experts) is written by transformers, block-quantized (128 x 128, e4m3, float32 scales, as the
published FP8 releases are) by the reference quantizer of the tests, and written again as the
exact dequantization of those FP8 values. On the same documents (random tokens, mixed
lengths), the bench takes the log-prob of every next token from:

- `reference`: transformers on the dequantized weights in bf16 (float32 log_softmax);
- `teacherq_fp8`: a teacherq scorer on the FP8 checkpoint (`model.fp8=auto`: FP8 weights, FP8
  GEMMs, the routed experts in the fused FP8 expert kernel);
- `teacherq_dequantized`: the same checkpoint with `model.fp8=dequantize` (how far teacherq's
  bf16 forward is from transformers' alone: the floor under the FP8 figures);
- `transformers_fp8`: transformers loading the FP8 checkpoint itself (`FP8Linear`, FP8
  experts), which needs the Hugging Face Hub's `kernels-community/finegrained-fp8` Triton
  kernel. Machines without network pass its Python package with `--hf-fp8-kernel DIR` (the
  directory holding `finegrained_fp8/`, as `kernels download` or the kernel's build writes
  it); without one, that side is reported as not run.

For each side against the reference: mean, 99th percentile and largest |d log-prob| over every
position, and how often the side's most likely next token is the reference's. The JSON
(`--out`) records the versions, the shape and every figure.

    python bench/fp8_accuracy.py --shape qwen3-8b --hf-fp8-kernel /path/to/kernel   # 2 layers
    python bench/fp8_accuracy.py --shape deepseek-v3 --hf-fp8-kernel /path/to/kernel
    python bench/fp8_accuracy.py --tiny --device cpu     # the plumbing, on the CPU
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_common import frontier, transformers_config, versions  # noqa: E402
from bench.gpu_e2e import MODELS  # noqa: E402
from bench.gpu_moe import randomize  # noqa: E402

BLOCK = [128, 128]
VOCAB = 32768  # the output layer stays bf16 on every side: its size does not change the error


def shape_config(name: str, layers: int, tiny: bool) -> dict:
    """config.json fields of the cut: `qwen3-8b` (all layers dense) or `deepseek-v3` (1 dense
    layer, the rest sparse, 32 routed experts in 8 groups: the real expert and hidden sizes,
    an eighth of the experts, so the checkpoints stay a few GB)."""
    if name == "qwen3-8b":
        cfg = {**MODELS["qwen3-8b"], "num_hidden_layers": layers, "vocab_size": VOCAB}
        if tiny:
            cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64)  # fmt: skip
        return cfg
    cfg = frontier("deepseek-v3", tiny=tiny, layers=layers, dense=1)
    cfg.update(vocab_size=VOCAB, n_routed_experts=32)
    if tiny:  # 128-multiples, so the blocks are whole
        cfg.update(hidden_size=256, moe_intermediate_size=128, intermediate_size=256)
    return cfg


def write_checkpoints(cfg: dict, root: Path, device: torch.device, seed: int) -> tuple[Path, Path]:
    """The random-init source checkpoint (transformers' save_pretrained, bf16), then its FP8
    version and the exact dequantization of that: (fp8 dir, reference dir)."""
    from transformers import AutoModelForCausalLM

    from tests.fp8_reference import write_fp8_pair

    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(transformers_config(cfg), dtype=torch.bfloat16)
    randomize(hf, seed)
    hf.save_pretrained(root / "source")
    del hf
    return write_fp8_pair(root / "source", root / "pair", BLOCK)


def documents(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[np.ndarray]:
    """`n` documents of random tokens, lengths drawn from [lo, hi]."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))) for _ in range(n)]


def transformers_side(path: Path, docs: list[np.ndarray], device: torch.device) -> dict:
    """transformers' next-token log-probs and most likely tokens of `docs` from the checkpoint
    at `path` (bf16 activations, float32 log_softmax), one document a forward; and whether any
    weight stayed in FP8 (an FP8 checkpoint on a device without FP8 kernels is dequantized)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"device_map": str(device)} if device.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, **kwargs)
    model = model.to(device).eval()
    fp8 = sum(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    lp, top = [], []
    with torch.no_grad():
        for ids in docs:
            x = torch.as_tensor(ids, device=device)[None]
            logp = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)
            lp.append(logp.gather(1, x[0, 1:, None])[:, 0].cpu().numpy())
            top.append(logp.argmax(-1).cpu().numpy())
    del model
    return {"logprobs": lp, "top1": top, "fp8_params": int(fp8)}


def teacherq_side(path: Path, docs: list[np.ndarray], device: torch.device, fp8: str) -> dict:
    """teacherq's next-token log-probs and top-1 tokens of `docs` from the checkpoint at
    `path` under `model.fp8=fp8`, all documents in one batch."""
    from consumer.checkpoints import load_hf_checkpoint
    from consumer.forward.scoring import Scorer
    from consumer.group.batching import batch_from_jobs
    from consumer.parallel import init_parallel
    from shared.messages import Job, TeacherRequest

    layout = init_parallel(tp=1, pp=1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, spec = load_hf_checkpoint(str(path), layout, params_dtype=dtype, device=device, fp8=fp8)
    fp8_params = sum(p.dtype == torch.float8_e4m3fn for p in model.parameters())
    scorer = Scorer(model=model, spec=spec, layout=layout, device=device)
    jobs = [Job(job_id=f"d{i}", entry_id=f"0-{i}", submitted_at=0.0,
                request=TeacherRequest(input_ids=ids.tolist(), top_k=1))
            for i, ids in enumerate(docs)]  # fmt: skip
    out = scorer.score(batch_from_jobs(jobs))
    del model, scorer
    return {"logprobs": [np.asarray(o["logprobs"]) for o in out],
            "top1": [np.asarray(o["topk_token_ids"])[:, 0] for o in out],
            "fp8_params": int(fp8_params)}  # fmt: skip


def against(side: dict, ref: dict) -> dict:
    """|d log-prob| of `side` against `ref` over every position, and top-1 agreement."""
    d = np.abs(np.concatenate(side["logprobs"]) - np.concatenate(ref["logprobs"]))
    same = np.concatenate(side["top1"]) == np.concatenate(ref["top1"])
    return {"mean_abs": float(d.mean()), "p99_abs": float(np.quantile(d, 0.99)),
            "max_abs": float(d.max()), "top1_agree": float(same.mean())}  # fmt: skip


def use_hub_kernel(directory: Path) -> str:
    """Make transformers' FP8 integration take the `finegrained_fp8` package found in
    `directory` where it would download it from the Hub; returns the package's file."""
    import transformers.integrations.finegrained_fp8 as tf_fp8

    sys.path.insert(0, str(directory))
    kernel = importlib.import_module("finegrained_fp8")
    tf_fp8.is_kernels_available = lambda: True
    tf_fp8.lazy_load_kernel = lambda name, *args, **kwargs: kernel
    return str(kernel.__file__)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=("qwen3-8b", "deepseek-v3"), default="qwen3-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a few-MB model of the same build")
    p.add_argument("--hf-fp8-kernel", type=Path, help="directory holding finegrained_fp8/")
    p.add_argument("--work", type=Path, help="where the checkpoints go (default a temp dir)")
    p.add_argument("--out", type=Path, help="write the report here as JSON")
    args = p.parse_args()

    from consumer import cpu_compat

    cpu_compat.apply()
    device = torch.device(args.device)
    cfg = shape_config(args.shape, args.layers, args.tiny)
    report: dict = {"shape": args.shape, "config": cfg, "block": BLOCK, "versions": versions()}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        t0 = time.perf_counter()
        fp8_dir, ref_dir = write_checkpoints(cfg, Path(tmp), device, args.seed)
        report["write_s"] = round(time.perf_counter() - t0, 1)
        docs = documents(args.docs, args.min_len, args.max_len, cfg["vocab_size"], args.seed)
        report["tokens"] = int(sum(len(d) for d in docs))
        ref = transformers_side(ref_dir, docs, device)
        sides = {"teacherq_fp8": lambda: teacherq_side(fp8_dir, docs, device, "auto"),
                 "teacherq_dequantized": lambda: teacherq_side(fp8_dir, docs, device,
                                                               "dequantize")}  # fmt: skip
        if args.hf_fp8_kernel:
            report["hf_fp8_kernel"] = use_hub_kernel(args.hf_fp8_kernel)
            sides["transformers_fp8"] = lambda: transformers_side(fp8_dir, docs, device)
        else:
            report["transformers_fp8"] = {"not_run": "no --hf-fp8-kernel (its kernel comes "
                                                     "from the Hugging Face Hub)"}  # fmt: skip
        got = {}
        for name, run in sides.items():
            try:
                got[name] = run()
            except Exception as exc:  # noqa: BLE001 - one side failing still reports the rest
                first = (str(exc).splitlines() or [""])[0]
                report[name] = {"error": f"{type(exc).__name__}: {first}"}
                continue
            report[name] = {"fp8_params": got[name]["fp8_params"], **against(got[name], ref)}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "teacherq_fp8" in got and "transformers_fp8" in got:
            report["teacherq_fp8_against_transformers_fp8"] = against(
                got["teacherq_fp8"], got["transformers_fp8"]
            )
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
