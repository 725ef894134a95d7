"""The 32-bit and bit-choosing optimizers, LAMB / LARS / Adagrad (8- and 32-bit) and GlobalOptimManager.

Oracles, on the CPU: a plain-PyTorch implementation of each rule written here (fp32, from bitsandbytes'
formulas), and bitsandbytes' own optimizers on its CPU backend (the same class names, the same steps).
fp32 states must agree to float rounding; 8-bit states to a small fraction of how far the parameters moved
(the states' 8-bit rounding differs between any two implementations).
"""

import math

import pytest
import torch

import anygpu.optim as ao

bnb = pytest.importorskip("bitsandbytes")

SHAPE = (64, 80)  # 5120 elements: above min_8bit_size, so 8-bit classes keep 8-bit states
STEPS = 6


@pytest.fixture(autouse=True)
def _fresh_manager():
    ao.GlobalOptimManager.get_instance().initialize()
    bnb.optim.GlobalOptimManager.get_instance().initialize()
    yield
    ao.GlobalOptimManager.get_instance().initialize()
    bnb.optim.GlobalOptimManager.get_instance().initialize()


def _grads(n=STEPS, shape=SHAPE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def _run(cls, p0, grads, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt


# -- plain PyTorch rules (bitsandbytes' CPU formulas) ------------------------------------------------------

def _plain(rule, p0, grads, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.0, max_unorm=0.0):
    p, s1, s2 = p0.clone().double(), torch.zeros_like(p0).double(), torch.zeros_like(p0).double()
    for t, g in enumerate(grads, 1):
        g = g.double()
        pnorm = p.norm()
        if rule in ("adam", "lamb"):
            s1 = betas[0] * s1 + (1 - betas[0]) * g
            s2 = betas[1] * s2 + (1 - betas[1]) * g * g
            c1, c2 = 1 - betas[0] ** t, math.sqrt(1 - betas[1] ** t)
            u = s1 / (s2.sqrt() + eps * c2)
            scale = min(1.0, max_unorm * pnorm / u.norm()) if max_unorm > 0 else 1.0
            p = p + (-lr * c2 / c1) * scale * u
        elif rule in ("momentum", "lars"):
            g = g + wd * p
            s1 = g if t == 1 else betas[0] * s1 + g
            scale = min(1.0, max_unorm * pnorm / s1.norm()) if max_unorm > 0 else 1.0
            p = p - lr * scale * s1
        elif rule == "adagrad":
            g = g + wd * p
            s1 = s1 + g * g
            p = p - lr * g / (s1.sqrt() + eps)
        elif rule == "rmsprop":
            g = g + wd * p
            s1 = betas[0] * s1 + (1 - betas[0]) * g * g
            p = p - lr * g / (s1.sqrt() + eps)
    return p.float()


PLAIN_CASES = [  # (anygpu class, its kwargs, plain rule, plain kwargs)
    ("Adam32bit", dict(lr=1e-2), "adam", dict(lr=1e-2)),
    ("LAMB32bit", dict(lr=1e-2), "lamb", dict(lr=1e-2, max_unorm=1.0)),
    ("LAMB", dict(lr=1e-2, max_unorm=0.05), "lamb", dict(lr=1e-2, max_unorm=0.05)),
    ("LARS32bit", dict(lr=0.1, momentum=0.9, weight_decay=1e-2), "lars",
     dict(lr=0.1, betas=(0.9,), wd=1e-2, max_unorm=0.02)),
    ("Adagrad32bit", dict(lr=1e-2, weight_decay=1e-2), "adagrad", dict(lr=1e-2, eps=1e-10, wd=1e-2)),
    ("SGD32bit", dict(lr=0.1, momentum=0.9), "momentum", dict(lr=0.1, betas=(0.9,))),
    ("RMSprop32bit", dict(lr=1e-2), "rmsprop", dict(lr=1e-2, betas=(0.99,))),
]


@pytest.mark.parametrize("name,kw,rule,plain_kw", PLAIN_CASES, ids=[c[0] for c in PLAIN_CASES])
def test_32bit_matches_the_plain_rule(name, kw, rule, plain_kw):
    p0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)) * 0.1  # small |p|: the trust ratio binds
    grads = _grads()
    ours, opt = _run(getattr(ao, name), p0, grads, **kw)
    assert all(s["state1"].dtype == torch.float32 for s in opt.state.values())
    expected = _plain(rule, p0, grads, **plain_kw)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    if rule in ("lamb", "lars"):  # the clipping happened: the unclipped rule lands elsewhere
        unclipped = _plain(rule, p0, grads, **{**plain_kw, "max_unorm": 0.0})
        assert (unclipped - expected).abs().max() > 10 * (ours - expected).abs().max() + 1e-4


BNB_32 = [("Adam32bit", dict(lr=1e-2, weight_decay=1e-2)), ("AdamW32bit", dict(lr=1e-2)),
          ("Adam", dict(lr=1e-2)), ("PagedAdamW32bit", dict(lr=1e-2)), ("PagedAdam", dict(lr=1e-2)),
          ("SGD32bit", dict(lr=0.1, momentum=0.9, weight_decay=1e-2)), ("SGD", dict(lr=0.1, momentum=0.9)),
          ("RMSprop32bit", dict(lr=1e-2, weight_decay=1e-2)), ("RMSprop", dict(lr=1e-2)),
          ("Lion32bit", dict(lr=1e-3, weight_decay=1e-2)), ("Lion", dict(lr=1e-3)), ("PagedLion32bit", dict(lr=1e-3)),
          ("PagedLion", dict(lr=1e-3)),
          ("Adagrad32bit", dict(lr=1e-2, weight_decay=1e-2)), ("Adagrad", dict(lr=1e-2)),
          ("LAMB32bit", dict(lr=1e-2)), ("LAMB", dict(lr=1e-2, max_unorm=0.05)),
          ("LARS32bit", dict(lr=0.1, momentum=0.9, weight_decay=1e-2)), ("LARS", dict(lr=0.1, momentum=0.9))]


@pytest.mark.parametrize("name,kw", BNB_32, ids=[c[0] for c in BNB_32])
def test_32bit_matches_bitsandbytes_cpu(name, kw):
    p0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2)) * 0.1
    grads = _grads(seed=3)
    ours, opt = _run(getattr(ao, name), p0, grads, **kw)
    theirs, ref = _run(getattr(bnb.optim, name), p0, grads, **kw)
    for p_ours, p_theirs in zip(opt.state, ref.state):
        assert opt.state[p_ours]["state1"].dtype == ref.state[p_theirs]["state1"].dtype == torch.float32
    # weight decay: bitsandbytes' CPU Adam decays before the update, ours (its CUDA kernel's order) after
    # (per step lr * wd * |lr * update|, |update| <= about 1 for Adam)
    wd = opt.param_groups[0]["weight_decay"]
    atol = 1e-6 + (1.5 * kw["lr"] ** 2 * wd * STEPS if "Adam" in name else 0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=atol)
    assert (ours - p0).abs().max() > 1e-4  # it moved


EIGHT = [("LAMB8bit", dict(lr=1e-2), "lamb", dict(lr=1e-2)),  # 8-bit states: no trust ratio (bitsandbytes)
         ("LARS8bit", dict(lr=0.1, momentum=0.9, weight_decay=1e-2), "lars",
          dict(lr=0.1, betas=(0.9,), wd=1e-2)),
         ("Adagrad8bit", dict(lr=1e-2, weight_decay=1e-2), "adagrad", dict(lr=1e-2, eps=1e-10, wd=1e-2))]


@pytest.mark.parametrize("name,kw,rule,plain_kw", EIGHT, ids=[c[0] for c in EIGHT])
def test_8bit_lamb_lars_adagrad_track_the_rule_and_bitsandbytes(name, kw, rule, plain_kw):
    p0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(6))
    grads = _grads(seed=7)
    ours, opt = _run(getattr(ao, name), p0, grads, **kw)
    assert all(s["state1"].dtype == torch.uint8 for s in opt.state.values())
    moved = (_plain(rule, p0, grads, **plain_kw) - p0).norm()
    assert (ours - _plain(rule, p0, grads, **plain_kw)).norm() < 0.03 * moved
    theirs, _ = _run(getattr(bnb.optim, name), p0, grads, **kw)
    assert (ours - theirs).norm() < 0.03 * moved
    # and not some other rule that happens to be close: plain SGD momentum is far off for the adaptive ones
    if rule != "lars":
        assert (ours - _plain("momentum", p0, grads, lr=kw["lr"], betas=(0.9,))).norm() > 0.5 * moved


def test_optim_bits_picks_the_state_precision():
    p0 = torch.randn(SHAPE)
    _, eight = _run(ao.Adam, p0, _grads(1), optim_bits=8)
    _, thirty_two = _run(ao.Adam, p0, _grads(1))
    assert next(iter(eight.state.values()))["state1"].dtype == torch.uint8
    assert next(iter(thirty_two.state.values()))["state1"].dtype == torch.float32
    with pytest.raises(ValueError, match="optim_bits"):
        ao.Adam([torch.nn.Parameter(p0)], optim_bits=16)


@pytest.mark.parametrize("cls,kw,arg", [
    ("LAMB", dict(bias_correction=False), "bias_correction"), ("LAMB", dict(adam_w_mode=False), "adam_w_mode"),
    ("LAMB8bit", dict(max_unorm=0.5), "max_unorm"), ("LARS", dict(lr=0.1), "momentum"),
    ("LARS", dict(lr=0.1, momentum=0.9, nesterov=True), "nesterov"), ("Adagrad", dict(lr_decay=0.1), "lr_decay"),
    ("Adagrad", dict(initial_accumulator_value=0.1), "initial_accumulator_value"),
    ("Adagrad8bit", dict(optim_bits=32), "optim_bits"), ("LAMB", dict(max_unorm=-1.0), "max_unorm")])
def test_bad_arguments_are_named(cls, kw, arg):
    with pytest.raises(ValueError, match=arg):
        getattr(ao, cls)([torch.nn.Parameter(torch.randn(4))], **kw)


# -- GlobalOptimManager ---------------------------------------------------------------------------------

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 80))


def _state_dtypes(lib):
    model = _model()
    mng = lib.optim.GlobalOptimManager.get_instance()
    mng.register_parameters(model.parameters())
    mng.register_module_override(model[0], "weight", {"optim_bits": 32})
    opt = lib.optim.Adam(model.parameters(), lr=1e-2, optim_bits=8)
    mng.override_config(model[1].weight, "lr", 0.0)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = model[1].weight.detach().clone()
    opt.step()
    return [opt.state[p]["state1"].dtype for p in model.parameters()], torch.equal(before, model[1].weight)


def test_manager_overrides_like_bitsandbytes():
    ours = _state_dtypes(__import__("anygpu"))
    theirs = _state_dtypes(bnb)
    assert ours == theirs
    assert ours[0][0] == torch.float32 and ours[0][1] == torch.uint8  # embedding 32-bit, linear weight 8-bit
    assert ours[1]  # lr 0 for that weight: unchanged


def test_manager_rejects_unknown_keys_and_direct_construction():
    mng = ao.GlobalOptimManager.get_instance()
    with pytest.raises(ValueError, match="config"):
        mng.override_config(torch.nn.Parameter(torch.randn(2)), "learning_rate", 0.1)
    with pytest.raises(ValueError, match="optim_bits"):
        mng.override_config(torch.nn.Parameter(torch.randn(2)), "optim_bits", 4)
    with pytest.raises(RuntimeError, match="get_instance"):
        ao.GlobalOptimManager()


@pytest.mark.parametrize("kw", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
                                dict(momentum=0.9, dampening=0.1, max_unorm=0.0)])
def test_pytorch_lars_matches_bitsandbytes(kw):
    p0 = torch.randn(SHAPE, generator=torch.Generator().manual_seed(8))
    grads = _grads(seed=9)
    ours, _ = _run(ao.PytorchLARS, p0, grads, lr=0.1, **kw)
    theirs, _ = _run(bnb.optim.PytorchLARS, p0, grads, lr=0.1, **kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert (ours - p0).abs().max() > 1e-3
