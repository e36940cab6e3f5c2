"""StatelessAdam: Adam / AdamW with its moments reset at every step, so it keeps no state.

Every update equals the first step of a freshly created Adam. With fresh moments at step 1,
for the (maximize-signed, for Adam mode L2-decayed) gradient g:

    m = (1 - b1) g        v = (1 - b2) g^2

With bias correction (m_hat = m / (1 - b1) = g, v_hat = v / (1 - b2) = g^2) the update is

    p <- p - lr * g / (|g| + eps)

and without bias correction (Adam's step with m, v used as they are) it is

    p <- p - lr * (1 - b1) * g / (sqrt(1 - b2) * |g| + eps)

`sqrt(v)` is computed as `sqrt(1 - b2) * |g|`, never through `g^2`, so large or tiny gradients
neither overflow nor flush to zero on the way. Decoupled weight decay (AdamW, `adam_w_mode=True`)
scales p by `1 - lr * weight_decay` first; L2 mode (`adam_w_mode=False`) adds
`weight_decay * p` to the gradient, after `maximize` has negated it, as torch.optim.Adam does.
Betas only matter without bias correction. No exp_avg / exp_avg_sq (8 bytes per fp32
parameter) and no step counter are ever stored.

`stateless_adam_in_megatron()` (and the `get_megatron_stateless_adam` factory) make
`megatron.core.optimizer.get_megatron_optimizer` build StatelessAdam where it would build Adam.
megatron is imported only inside those two, so importing this module costs torch only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = [
    "MegatronStatelessAdamError",
    "StatelessAdam",
    "check_megatron_config",
    "get_megatron_stateless_adam",
    "optimizer_state_bytes",
    "stateless_adam_in_megatron",
]

# Group keys StatelessAdam reads beyond torch.optim.Adam's lr / betas / eps / weight_decay.
_OWN_GROUP_KEYS = ("amsgrad", "bias_correction", "adam_w_mode", "maximize", "use_decoupled_grad")

_AMSGRAD_REFUSAL = (
    "StatelessAdam does not support amsgrad=True: AMSGrad keeps a running maximum of "
    "exp_avg_sq across steps, which is exactly the state StatelessAdam does not keep; "
    "use torch.optim.Adam(amsgrad=True) instead"
)


class StatelessAdam(Optimizer):
    """Adam / AdamW whose moments restart at every step: no exp_avg, exp_avg_sq or step state.

    Takes the arguments of torch.optim.Adam plus those of apex / Transformer Engine FusedAdam
    (`bias_correction`, `adam_w_mode`, `use_decoupled_grad`), so either can be swapped for it.
    `adam_w_mode=True` (the default, as in FusedAdam) decays weights as AdamW; False adds L2
    decay to the gradient as Adam. `use_decoupled_grad=True` reads `param.decoupled_grad`
    instead of `param.grad`. amsgrad and sparse gradients are refused. See the module docstring
    for the update rule.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        maximize: bool = False,
        use_decoupled_grad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError(_AMSGRAD_REFUSAL)
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": False,
            "bias_correction": bool(bias_correction),
            "adam_w_mode": bool(adam_w_mode),
            "maximize": bool(maximize),
            "use_decoupled_grad": bool(use_decoupled_grad),
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group, refusing amsgrad and invalid hyper-parameters in it."""
        if param_group.get("amsgrad", False):
            raise ValueError(_AMSGRAD_REFUSAL)
        _check_hyperparameters(
            param_group.get("lr", self.defaults["lr"]),
            param_group.get("betas", self.defaults["betas"]),
            param_group.get("eps", self.defaults["eps"]),
            param_group.get("weight_decay", self.defaults["weight_decay"]),
        )
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Groups unpickled from an older or foreign optimizer may lack StatelessAdam's own keys.
        for group in self.param_groups:
            for key in _OWN_GROUP_KEYS:
                group.setdefault(key, self.defaults[key])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Apply one fresh-moment Adam update to every parameter that has a gradient.

        Returns the closure's loss if a closure is given (evaluated with grad enabled).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group.get("amsgrad", False):
                raise ValueError(_AMSGRAD_REFUSAL)
            if group["bias_correction"]:
                step_scale, denom_scale = 1.0, 1.0
            else:
                beta1, beta2 = (_as_float(b) for b in group["betas"])
                step_scale, denom_scale = 1.0 - beta1, math.sqrt(1.0 - beta2)
            grad_attr = "decoupled_grad" if group["use_decoupled_grad"] else "grad"
            for param in group["params"]:
                grad = getattr(param, grad_attr, None)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(
                        "StatelessAdam does not support sparse gradients; use "
                        "torch.optim.SparseAdam for sparse embeddings"
                    )
                _fresh_adam_update(
                    param,
                    grad,
                    lr=group["lr"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    adam_w_mode=group["adam_w_mode"],
                    maximize=group["maximize"],
                    step_scale=step_scale,
                    denom_scale=denom_scale,
                )
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients; with use_decoupled_grad also `param.decoupled_grad`."""
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            if not group["use_decoupled_grad"]:
                continue
            for param in group["params"]:
                grad = getattr(param, "decoupled_grad", None)
                if grad is None:
                    continue
                if set_to_none:
                    param.decoupled_grad = None
                else:
                    grad.detach_()
                    grad.zero_()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load hyper-parameters from a StatelessAdam, torch Adam/AdamW or FusedAdam state_dict.

        Per-parameter state (exp_avg, exp_avg_sq, max_exp_avg_sq, step) is dropped: StatelessAdam
        restarts its moments at every step anyway. The saved groups' hyper-parameters win, as in
        torch.optim; a torch Adam/AdamW group's `decoupled_weight_decay` becomes `adam_w_mode`.
        Keys StatelessAdam needs that the saved groups lack keep their current values. A group
        saved with amsgrad=True is refused.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer "
                f"has {len(self.param_groups)}"
            )
        groups = []
        for saved, current in zip(saved_groups, self.param_groups, strict=True):
            if saved.get("amsgrad", False):
                raise ValueError(
                    "cannot load an amsgrad=True optimizer state into StatelessAdam: "
                    + _AMSGRAD_REFUSAL
                )
            group = dict(saved)
            if "adam_w_mode" not in group and "decoupled_weight_decay" in group:
                group["adam_w_mode"] = bool(group["decoupled_weight_decay"])
            for key in _OWN_GROUP_KEYS:
                group.setdefault(key, current[key])
            groups.append(group)
        super().load_state_dict({"state": {}, "param_groups": groups})


def _check_hyperparameters(lr: Any, betas: Any, eps: float, weight_decay: float) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair, got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, Tensor) and beta.numel() != 1:
            raise ValueError(f"Tensor betas[{i}] must be 1-element")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not weight_decay >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def _as_float(value: float | Tensor) -> float:
    return float(value.item()) if isinstance(value, Tensor) else float(value)


def _fresh_adam_update(
    param: Tensor,
    grad: Tensor,
    *,
    lr: float | Tensor,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    maximize: bool,
    step_scale: float,
    denom_scale: float,
) -> None:
    if torch.is_complex(param):
        # torch.optim.Adam treats a complex parameter as its (real, imag) pairs.
        param = torch.view_as_real(param)
        grad = torch.view_as_real(grad)
    # The denominator only sees |g|, so maximize can flip the step's sign instead of
    # materialising -g, unless L2 decay has to be added to the negated gradient.
    sign = -1.0 if maximize else 1.0
    if isinstance(lr, Tensor):
        lr = lr.reshape(())  # a [1]-shaped lr would not broadcast into a 0-d parameter
    if weight_decay != 0:
        if adam_w_mode:
            param.mul_(1 - lr * weight_decay)
        elif maximize:
            grad = param.mul(weight_decay).sub_(grad)
            sign = 1.0
        else:
            grad = grad.add(param, alpha=weight_decay)
    denom = grad.abs()
    if denom_scale != 1.0:
        denom.mul_(denom_scale)
    denom.add_(eps)
    if isinstance(lr, Tensor):
        # addcdiv_ takes only a Python number as its scale; a tensor lr (e.g. from a scheduler
        # that keeps it on the device) scales the quotient instead, without a host sync.
        update = torch.div(grad, denom, out=denom).mul_(lr * (sign * step_scale))
        param.sub_(update)
    else:
        param.addcdiv_(grad, denom, value=-sign * lr * step_scale)


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes held by tensors in an optimizer's per-parameter state (megatron wrappers included).

    Counts every tensor found in `optimizer.state` values, nested dicts and lists included,
    once per storage; a megatron ChainedOptimizer's proxy state is walked through its parts.
    """
    seen: set[tuple[int, int]] = set()
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, Tensor):
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, list | tuple):
            for value in obj:
                visit(value)

    for state in _state_dicts(optimizer):
        for per_param in state.values():
            visit(per_param)
    return total


def _state_dicts(optimizer: Any) -> Iterator[dict]:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for part in chained:
            yield from _state_dicts(part)
        return
    if not isinstance(optimizer, Optimizer) and hasattr(optimizer, "optimizer"):
        # A megatron wrapper; its inner optimizer is None on a rank without trainable params.
        if optimizer.optimizer is not None:
            yield from _state_dicts(optimizer.optimizer)
        return
    yield optimizer.state


# --- megatron-core integration -------------------------------------------------------------


class MegatronStatelessAdamError(ValueError):
    """A megatron-core optimizer setup that would save, load or allocate Adam moment state."""


def check_megatron_config(config: Any, model_chunks: Iterable[Any] | None = None) -> None:
    """Refuse megatron-core 0.16 optimizer setups that would store or expect Adam moments.

    `config` is a megatron OptimizerConfig; `model_chunks` (optional) are the model chunks
    whose `ddp_config` is checked too. Raises MegatronStatelessAdamError listing every reason.
    """
    reasons = []
    if config.optimizer != "adam":
        reasons.append(
            f"config.optimizer is {config.optimizer!r}; StatelessAdam only replaces 'adam'"
        )
    if config.use_distributed_optimizer:
        reasons.append(
            "use_distributed_optimizer=True: megatron's DistributedOptimizer keeps its own "
            "'param'/'exp_avg'/'exp_avg_sq' shard buffers for checkpoints "
            "(get_parameter_state_dp_zero, sharded_param_state, load_parameter_state) and "
            "allocates exp_avg/exp_avg_sq shards itself in load_state_dict"
        )
    if config.use_precision_aware_optimizer:
        reasons.append(
            "use_precision_aware_optimizer=True: it stores exp_avg/exp_avg_sq at "
            "exp_avg_dtype/exp_avg_sq_dtype inside Transformer Engine's FusedAdam "
            "(initialize_state, master weights); StatelessAdam has no moments to store"
        )
    if config.optimizer_cpu_offload:
        reasons.append(
            "optimizer_cpu_offload=True: HybridDeviceOptimizer builds its own torch AdamW "
            "with exp_avg/exp_avg_sq on the CPU side; a stateless optimizer has nothing to "
            "offload"
        )
    for chunk in model_chunks or ():
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None:
            continue
        if getattr(ddp_config, "use_megatron_fsdp", False):
            reasons.append(
                "ddp_config.use_megatron_fsdp=True: Megatron FSDP shards and checkpoints "
                "exp_avg/exp_avg_sq (fsdp_dtensor format) through the distributed optimizer"
            )
        if getattr(ddp_config, "use_distributed_optimizer", False):
            reasons.append(
                "ddp_config.use_distributed_optimizer=True: the model's grad buffers are laid "
                "out for megatron's DistributedOptimizer, which StatelessAdam cannot back"
            )
        break  # megatron reads the first chunk's ddp_config for all chunks
    if reasons:
        raise MegatronStatelessAdamError(
            "StatelessAdam cannot back this megatron-core optimizer setup:\n- "
            + "\n- ".join(reasons)
        )


def _no_moment_state(optimizer: Any, config: Any = None) -> None:
    """Stand-in for megatron's Adam init_state_fn: StatelessAdam has no state to allocate.

    megatron calls init_state_fn before building a state dict to load a checkpoint into
    (FP32Optimizer.sharded_state_dict, Float16Optimizer.state_dict/sharded_state_dict);
    upstream it fills exp_avg / exp_avg_sq with zeros, so moments in a loaded checkpoint
    would be read and kept. With no template entries they are simply not loaded.
    """
    return None


def _make_stateless(built: Any) -> None:
    # megatron returns FP32Optimizer / Float16OptimizerWithFloat16Params here, inner optimizer
    # None on a rank without trainable parameters.
    inner = getattr(built, "optimizer", None)
    if inner is not None and not isinstance(inner, StatelessAdam):
        raise MegatronStatelessAdamError(
            f"megatron built {type(inner).__name__}, not StatelessAdam; this megatron-core "
            "version chooses its Adam differently than stateless_adam_in_megatron expects"
        )
    built.init_state_fn = _no_moment_state


@contextlib.contextmanager
def stateless_adam_in_megatron() -> Iterator[None]:
    """Within this block, megatron's get_megatron_optimizer builds StatelessAdam for Adam.

    megatron-core 0.16 picks Adam in `_get_megatron_optimizer_based_on_param_groups`: TE or
    apex FusedAdam (module global `Adam`, given `adam_w_mode=config.decoupled_weight_decay`)
    or, without them, torch.optim.Adam/AdamW. The block points `Adam` at StatelessAdam, takes
    the FusedAdam branch (StatelessAdam accepts its arguments), checks each config with
    `check_megatron_config` first, and replaces the Adam `init_state_fn` of what was built
    with one that allocates nothing. Module globals are restored on exit; building is not
    thread-safe against other code building megatron optimizers at the same time.
    """
    from megatron.core import optimizer as megatron_optimizer

    names = ("Adam", "USING_PYTORCH_OPTIMIZER", "_get_megatron_optimizer_based_on_param_groups")
    saved = {name: getattr(megatron_optimizer, name) for name in names}
    build = saved["_get_megatron_optimizer_based_on_param_groups"]

    def build_stateless(*args: Any, **kwargs: Any) -> Any:
        config = kwargs["config"] if "config" in kwargs else args[0]
        chunks = kwargs["model_chunks"] if "model_chunks" in kwargs else args[1]
        check_megatron_config(config, chunks)
        built = build(*args, **kwargs)
        _make_stateless(built)
        return built

    megatron_optimizer.Adam = StatelessAdam
    megatron_optimizer.USING_PYTORCH_OPTIMIZER = False
    megatron_optimizer._get_megatron_optimizer_based_on_param_groups = build_stateless
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(megatron_optimizer, name, value)


def get_megatron_stateless_adam(config: Any, model_chunks: list[Any], **kwargs: Any) -> Any:
    """`megatron.core.optimizer.get_megatron_optimizer` with StatelessAdam in place of Adam.

    Arguments are those of get_megatron_optimizer. Raises MegatronStatelessAdamError for
    setups that would store or expect moment state (see check_megatron_config).
    """
    check_megatron_config(config, model_chunks)
    from megatron.core.optimizer import get_megatron_optimizer

    with stateless_adam_in_megatron():
        return get_megatron_optimizer(config, model_chunks, **kwargs)
