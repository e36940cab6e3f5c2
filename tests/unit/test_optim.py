"""StatelessAdam against torch.optim.Adam / AdamW re-created at every step, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from producer.optim import StatelessAdam, optimizer_state_bytes

STEPS = 5
LR = 0.05
EPS = 1e-8
CLOSE = {"rtol": 1e-12, "atol": 1e-15}


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (5,), ()]
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]


def _grads(seed: int = 1, steps: int = STEPS) -> list[list[torch.Tensor]]:
    """Gradients that change every step, spanning magnitudes around and far from eps."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        scale = 10.0 ** (step - 2)  # 1e-2 ... 1e2
        grads = [
            scale * torch.randn(p.shape, generator=gen, dtype=torch.float64) for p in _params()
        ]
        grads[0][0, 0] = 0.0  # an exact zero gradient entry must stay put (0 / eps)
        grads[1][0] = 3e-9  # below eps: Adam's update is far from sign(g) here
        out.append(grads)
    return out


def _leaves(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone().requires_grad_(True) for t in tensors]


def _run_stateless(grads_per_step, **kwargs) -> list[torch.Tensor]:
    params = _leaves(_params())
    opt = StatelessAdam(params, **kwargs)
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
    return [p.detach() for p in params]


def _run_fresh_torch(grads_per_step, cls, **kwargs) -> list[torch.Tensor]:
    """The reference: a new torch optimizer (zero moments, step 0) before every step."""
    params = _leaves(_params())
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        cls(params, foreach=False, **kwargs).step()
    return [p.detach() for p in params]


def _assert_all_close(actual, expected, **tol) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **(tol or CLOSE))


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize(
    ("adam_w_mode", "reference"), [(True, torch.optim.AdamW), (False, torch.optim.Adam)]
)
def test_equals_torch_adam_recreated_every_step(adam_w_mode, reference, weight_decay, maximize):
    grads = _grads()
    hyper = {"lr": LR, "betas": (0.8, 0.95), "eps": EPS, "weight_decay": weight_decay}
    ours = _run_stateless(grads, adam_w_mode=adam_w_mode, maximize=maximize, **hyper)
    expected = _run_fresh_torch(grads, reference, maximize=maximize, **hyper)
    _assert_all_close(ours, expected)

    # Not vacuous: one persistent torch optimizer, keeping its moments, ends elsewhere.
    params = _leaves(_params())
    persistent = reference(params, foreach=False, maximize=maximize, **hyper)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        persistent.step()
    assert not torch.allclose(params[0].detach(), ours[0], rtol=1e-6, atol=0)


def test_adam_w_mode_and_l2_mode_differ_with_weight_decay():
    grads = _grads()
    decoupled = _run_stateless(grads, lr=LR, weight_decay=0.1, adam_w_mode=True)
    l2 = _run_stateless(grads, lr=LR, weight_decay=0.1, adam_w_mode=False)
    assert not torch.allclose(decoupled[0], l2[0], rtol=1e-6, atol=0)


def _no_bias_correction_reference(grads_per_step, *, lr, betas, eps, weight_decay, adam_w_mode):
    """Adam's first step from zero moments, with m and v used without bias correction."""
    b1, b2 = betas
    params = [p.clone() for p in _params()]
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            if adam_w_mode:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g + weight_decay * p
            m = (1 - b1) * g
            v = (1 - b2) * g * g
            p.sub_(lr * m / (v.sqrt() + eps))
    return params


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_without_bias_correction_equals_closed_form(adam_w_mode, weight_decay):
    grads = _grads()
    hyper = {"lr": LR, "betas": (0.8, 0.95), "eps": EPS, "weight_decay": weight_decay}
    ours = _run_stateless(grads, bias_correction=False, adam_w_mode=adam_w_mode, **hyper)
    _assert_all_close(ours, _no_bias_correction_reference(grads, adam_w_mode=adam_w_mode, **hyper))

    # Second reference: torch Adam's bias-corrected step 1 equals the uncorrected one with
    # lr' = lr (1 - b1) / sqrt(1 - b2) and eps' = eps / sqrt(1 - b2); AdamW's decay factor
    # 1 - lr' wd' stays 1 - lr wd with wd' = wd lr / lr'.
    b1, b2 = hyper["betas"]
    lr_t = LR * (1 - b1) / math.sqrt(1 - b2)
    torch_hyper = {
        "lr": lr_t,
        "betas": hyper["betas"],
        "eps": EPS / math.sqrt(1 - b2),
        "weight_decay": weight_decay * LR / lr_t if adam_w_mode else weight_decay,
    }
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    _assert_all_close(ours, _run_fresh_torch(grads, cls, **torch_hyper), rtol=1e-10, atol=1e-14)

    corrected = _run_stateless(grads, adam_w_mode=adam_w_mode, **hyper)
    assert not torch.allclose(ours[0], corrected[0], rtol=1e-6, atol=0)


def test_maximize_without_bias_correction_flips_the_update():
    grads = _grads()
    start = _params()
    down = _run_stateless(grads[:1], lr=LR, bias_correction=False)
    up = _run_stateless(grads[:1], lr=LR, bias_correction=False, maximize=True)
    for s, d, u in zip(start, down, up, strict=True):
        torch.testing.assert_close(u - s, s - d, **CLOSE)


def test_tensor_lr_equals_float_lr():
    grads = _grads()
    for kwargs in ({"adam_w_mode": True}, {"adam_w_mode": False}, {"bias_correction": False}):
        as_float = _run_stateless(grads, lr=LR, weight_decay=0.1, maximize=True, **kwargs)
        as_tensor = _run_stateless(
            grads,
            lr=torch.tensor([LR], dtype=torch.float64),
            weight_decay=0.1,
            maximize=True,
            **kwargs,
        )
        _assert_all_close(as_tensor, as_float)


def test_complex_parameters_follow_torch_adam():
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(6, dtype=torch.complex128, generator=gen)
    grads = [torch.randn(6, dtype=torch.complex128, generator=gen) for _ in range(STEPS)]
    ours, ref = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    opt = StatelessAdam([ours], lr=LR, weight_decay=0.1)
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        torch.optim.AdamW([ref], lr=LR, weight_decay=0.1, foreach=False).step()
    torch.testing.assert_close(ours.detach(), ref.detach(), **CLOSE)


def test_float32_huge_gradient_matches_float64_adam():
    # In float32, torch Adam's g*g overflows for |g| > ~1.8e19 and freezes the parameter;
    # StatelessAdam forms sqrt(v) from |g| and takes the step float64 Adam takes.
    grad = torch.tensor([3e25, -2e22, 1e-30, 0.5])
    ours = torch.zeros(4, requires_grad=True)
    ours.grad = grad.clone()
    StatelessAdam([ours], lr=LR).step()
    ref = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    ref.grad = grad.double()
    torch.optim.Adam([ref], lr=LR, foreach=False).step()
    torch.testing.assert_close(ours.detach(), ref.detach().float(), rtol=1e-6, atol=1e-30)
    assert ours[0].item() == pytest.approx(-LR)
    frozen = torch.zeros(4, requires_grad=True)
    frozen.grad = grad.clone()
    torch.optim.Adam([frozen], lr=LR, foreach=False).step()
    assert frozen[0].item() == 0.0  # the overflow this guards against is real


def test_state_stays_empty_while_torch_adam_allocates_moments():
    grads = _grads()
    params = _leaves(_params())
    opt = StatelessAdam(params, lr=LR, weight_decay=0.1)
    adam_params = _leaves(_params())
    adam = torch.optim.Adam(adam_params, lr=LR, weight_decay=0.1)
    for step_grads in grads:
        for p, q, g in zip(params, adam_params, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        adam.step()
    assert len(opt.state) == 0
    assert opt.state_dict()["state"] == {}
    assert optimizer_state_bytes(opt) == 0
    numel = sum(p.numel() for p in adam_params)
    steps_bytes = sum(adam.state[p]["step"].numel() * 4 for p in adam_params)  # float32 step
    assert optimizer_state_bytes(adam) == 2 * numel * 8 + steps_bytes  # exp_avg + exp_avg_sq


def test_params_without_grad_are_skipped():
    params = _leaves(_params())
    before = [p.detach().clone() for p in params]
    opt = StatelessAdam(params, lr=LR, weight_decay=0.1)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert not torch.equal(params[0].detach(), before[0])
    for p, b in zip(params[1:], before[1:], strict=True):
        assert torch.equal(p.detach(), b)  # weight decay is not applied either, as in Adam
    assert len(opt.state) == 0


def test_decoupled_grad_is_read_instead_of_grad():
    grads = _grads()[0]
    params = _leaves(_params())
    opt = StatelessAdam(params, lr=LR, use_decoupled_grad=True)
    for p, g in zip(params, grads, strict=True):
        p.decoupled_grad = g.clone()
        p.grad = torch.full_like(p, 123.0)  # must be ignored
    params[2].decoupled_grad = None  # and a None decoupled_grad skips the parameter
    opt.step()
    expected = _run_stateless([[grads[0], grads[1], None]], lr=LR)
    _assert_all_close([p.detach() for p in params[:2]], expected[:2])
    assert torch.equal(params[2].detach(), _params()[2])

    opt.zero_grad()
    assert all(getattr(p, "decoupled_grad", None) is None and p.grad is None for p in params)


def test_closure_loss_is_returned():
    param = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = StatelessAdam([param], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (param**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx(5.0)
    torch.testing.assert_close(param.detach(), torch.tensor([0.9, -1.9]))


def test_amsgrad_is_refused():
    with pytest.raises(ValueError, match="amsgrad"):
        StatelessAdam(_leaves(_params()), amsgrad=True)
    opt = StatelessAdam(_leaves(_params())[:1])
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": _leaves(_params())[1:], "amsgrad": True})


def test_sparse_gradients_are_refused():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match="sparse"):
        StatelessAdam(emb.parameters()).step()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": -1.0},
        {"eps": -1.0},
        {"betas": (1.0, 0.9)},
        {"betas": (0.9, -0.1)},
        {"weight_decay": -0.1},
        {"lr": torch.tensor([0.1, 0.2])},
    ],
)
def test_invalid_hyperparameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        StatelessAdam(_leaves(_params()), **kwargs)


@pytest.mark.parametrize(("cls", "w_mode"), [(torch.optim.Adam, False), (torch.optim.AdamW, True)])
def test_loading_torch_adam_state_dict_drops_moments_keeps_hyperparameters(cls, w_mode):
    params = _leaves(_params())
    hyper = {"lr": 0.03, "betas": (0.7, 0.9), "eps": 1e-6, "weight_decay": 0.2}
    adam = cls(params, maximize=True, **hyper)
    for step_grads in _grads()[:2]:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        adam.step()
    saved = adam.state_dict()
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(saved["state"][0])

    opt = StatelessAdam(params, lr=1.0, adam_w_mode=not w_mode, bias_correction=False)
    opt.load_state_dict(saved)
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    assert "exp_avg" in saved["state"][0]  # the caller's state dict is left as it was
    group = opt.param_groups[0]
    assert group["lr"] == 0.03 and group["betas"] == (0.7, 0.9) and group["eps"] == 1e-6
    assert group["weight_decay"] == 0.2 and group["maximize"] is True
    assert group["adam_w_mode"] is w_mode  # from the saved decoupled_weight_decay
    assert group["bias_correction"] is False  # not in the saved group: kept

    # The loaded hyper-parameters drive the next step: fresh torch optimizer of the same kind
    # with bias correction turned back on must match.
    group["bias_correction"] = True
    grads = _grads()[2]
    ref = _leaves([p.detach() for p in params])
    for p, q, g in zip(params, ref, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    cls(ref, maximize=True, foreach=False, **hyper).step()
    _assert_all_close([p.detach() for p in params], [q.detach() for q in ref])
    assert len(opt.state) == 0


def test_loading_amsgrad_state_dict_is_refused():
    params = _leaves(_params())
    adam = torch.optim.Adam(params, amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        StatelessAdam(params).load_state_dict(adam.state_dict())


def test_state_dict_round_trip_keeps_own_keys():
    params = _leaves(_params())
    src = StatelessAdam(params, lr=0.2, bias_correction=False, adam_w_mode=False, maximize=True)
    dst = StatelessAdam(params)
    dst.load_state_dict(src.state_dict())
    for key in ("lr", "bias_correction", "adam_w_mode", "maximize", "use_decoupled_grad"):
        assert dst.param_groups[0][key] == src.param_groups[0][key]
    assert dst.state_dict()["state"] == {}


def test_import_does_not_pull_in_megatron():
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, producer.optim; print('megatron' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert out.stdout.strip() == "False"
