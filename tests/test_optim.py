import itertools
import math

import pytest
import torch

from sixfold.config import ConfigError, ModelConfig, TrainConfig, load_config
from sixfold.model.llama import Llama, init_weights, no_decay
from sixfold.optim import MOMENTS, AdamW, clip_scale, learning_rate
from sixfold.comm import Comm
from sixfold.mesh import ParallelContext
from sixfold.parallel.sharding import Sharded
from sixfold.trace import Tracer
from helpers import TINY


def _models(tie=False):
    cfg = ModelConfig(tie_embeddings=tie)
    a, b = Llama(cfg), Llama(cfg)
    init_weights(a, 7)
    init_weights(b, 7)
    return a, b


def _sharded(model, **dtypes):
    return Sharded(model, Comm(ParallelContext.single(), Tracer(False, 0)), zero=0, **dtypes)


def _plain_optimizer(model, t, fused):
    decay = [p for n, p in model.named_parameters() if not no_decay(n)]
    rest = [p for n, p in model.named_parameters() if no_decay(n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=fused)


def _batch(gen):
    return torch.randint(0, 320, (2, 16), generator=gen), torch.randint(0, 320, (2, 16), generator=gen)


def _run_both(tie, fused):
    ours, plain = _models(tie)
    t = TrainConfig(steps=6, lr=3e-3, warmup_steps=2, grad_clip=0.0)
    flat = _sharded(ours)
    assert len(flat.units) == ours.cfg.n_layers + 2
    opt = AdamW(flat, t, no_decay)
    ref = _plain_optimizer(plain, t, fused)
    gen = torch.Generator().manual_seed(0)
    for step in range(t.steps):
        x, y = _batch(gen)
        ours.loss_sum(x, y).backward()
        plain.loss_sum(x, y).backward()
        lr = learning_rate(t, step)
        for g in ref.param_groups:
            g["lr"] = lr
        opt.step(lr)
        ref.step()
        flat.zero_grad()
        ref.zero_grad()
    assert opt.step_count == t.steps
    return ours, plain, (flat, opt, ref)


def test_adamw_on_flat_views_matches_torch_bitwise():
    """AdamW over the flat buffers, with the schedule, equals torch.optim.AdamW(fused=True) exactly: weights and
    both moments."""
    for tie in (False, True):
        ours, plain, (flat, opt, ref) = _run_both(tie, fused=True)
        for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
            assert torch.equal(p, q), name
        params = dict(plain.named_parameters())
        for unit in flat.units:
            for name, a, b, _ in unit.segments():
                state = ref.state[params[name]]
                for k in MOMENTS:
                    assert torch.equal(opt.moments[unit.index][k][a:b], state[k].flatten()), (name, k)


def test_adamw_matches_torch_default_implementation():
    """Against the default (for-loop) AdamW: a different kernel, so equal to fp32 round-off."""
    ours, plain, _ = _run_both(False, fused=False)
    for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA kernel's grad_scale"))])
def test_clipping_matches_torch(device):
    """Clipping by AdamW's kernel as it reads the gradients (its grad_scale) against torch's clip_grad_norm_ before
    its fused AdamW: the norm (fp64 here, fp32 in torch), the weights and both moments agree to fp32 round-off."""
    ours, plain = (m.to(device) for m in _models())
    t = TrainConfig(lr=3e-3, grad_clip=0.5)
    flat = _sharded(ours)
    opt, ref = AdamW(flat, t, no_decay), _plain_optimizer(plain, t, fused=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = (t.to(device) for t in _batch(gen))
        ours.loss_sum(x, y).backward()
        plain.loss_sum(x, y).backward()
        n1 = math.sqrt(flat.grad_norm_sq())
        n2 = torch.nn.utils.clip_grad_norm_(plain.parameters(), t.grad_clip)
        assert n1 > t.grad_clip
        assert math.isclose(n1, float(n2), rel_tol=1e-6)
        opt.step(t.lr, scale=clip_scale(n1, t.grad_clip))
        ref.step()
        flat.zero_grad()
        ref.zero_grad()
    params = dict(plain.named_parameters())
    for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    for unit in flat.units:
        for name, a, b, _ in unit.segments():
            for k in MOMENTS:  # (the two norms differ by fp32 round-off, so every scaled gradient does too: an
                # element near 0 after the moment's sums cancel is compared on the scale of the whole tensor)
                expected = ref.state[params[name]][k].flatten()
                torch.testing.assert_close(opt.moments[unit.index][k][a:b], expected, rtol=1e-6,
                                           atol=1e-6 * float(expected.abs().max()), msg=f"{name} {k}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA kernel's grad_scale"))])
def test_clipping_a_norm_past_float32_range_scales_the_gradients(device):
    """A clip of 1e-39 (past float32's range as the kernel's divisor, which made torch.full raise): the update is
    that of the gradients so scaled, against torch's fused AdamW given them scaled in fp64."""
    ours, plain = (m.to(device) for m in _models())
    t = TrainConfig(lr=3e-3, grad_clip=1e-39)
    flat = _sharded(ours)
    opt, ref = AdamW(flat, t, no_decay), _plain_optimizer(plain, t, fused=True)
    x, y = (v.to(device) for v in _batch(torch.Generator().manual_seed(2)))
    ours.loss_sum(x, y).backward()
    flat.finish()
    big = 1e37 / max(float(u.grad_shard.abs().max()) for u in flat.units)  # the largest gradient 1e37: finite
    for unit in flat.units:
        unit.grad_shard.mul_(big)
    for unit in flat.units:
        for name, a, b, _ in unit.segments():
            p = ours.get_parameter(name)
            plain.get_parameter(name).grad = (unit.grad_shard[a:b].double() * t.grad_clip).float().view_as(p)
    before = [p.detach().clone() for p in ours.parameters()]
    opt.step(t.lr, scale=t.grad_clip)
    ref.step()
    for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    assert max(float((p - b).abs().max()) for p, b in zip(ours.parameters(), before)) > t.lr / 2  # not a nil step


def test_a_gradient_norm_past_float32_squares_is_finite():
    """Elements of 1e20 and more (their squares past float32, where torch's norm of them is inf): the norm is still
    their norm, and clipping by it works; an infinite element leaves it infinite (the step skipped)."""
    model = _models()[0]
    flat = _sharded(model)
    model.loss_sum(*_batch(torch.Generator().manual_seed(3))).backward()
    flat.finish()
    expected = math.sqrt(sum(float(u.grad_shard.double().norm()) ** 2 for u in flat.units))
    for unit in flat.units:
        unit.grad_shard.mul_(1e24)
    assert math.isclose(math.sqrt(flat.grad_norm_sq()), expected * 1e24, rel_tol=1e-6)
    flat.units[1].grad_shard[5] = math.inf
    assert flat.grad_norm_sq() == math.inf


def test_clip_scale():
    assert clip_scale(2.0, 1.0) == pytest.approx(0.5)
    assert clip_scale(0.5, 1.0) == 1.0
    assert clip_scale(2.0, 0.0) == 1.0  # off
    assert clip_scale(math.inf, 1.0) == clip_scale(math.nan, 1.0) == 1.0  # such a step is skipped, not scaled


def test_schedule_shape():
    t = TrainConfig(steps=10, lr=1.0, min_lr=0.1, warmup_steps=3)
    lrs = [learning_rate(t, s) for s in range(10)]
    assert lrs[:4] == [1 / 3, 2 / 3, 1.0, 1.0]
    assert math.isclose(lrs[-1], 0.1)
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))
    assert math.isclose(lrs[6], 0.55)  # half way through the decay: half way down


@pytest.mark.parametrize("schedule, decay_steps, after_warmup", [
    ("linear", 0, [1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1]),
    ("linear", 4, [1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1]),  # warmup, stable, decay (WSD)
    ("cosine", 3, [1.0, 1.0, 1.0, 1.0, 0.775, 0.325, 0.1]),
    ("linear", 1, [1.0] * 6 + [0.1]),
    ("linear", 50, [1.0, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1]),  # longer than the run: from the end of warmup
    ("constant", 0, [1.0] * 7),
])
def test_schedules_decay_over_their_last_steps(schedule, decay_steps, after_warmup):
    t = TrainConfig(steps=10, lr=1.0, min_lr=0.1, warmup_steps=3, schedule=schedule, decay_steps=decay_steps)
    lrs = [learning_rate(t, s) for s in range(10)]
    assert lrs[:3] == [1 / 3, 2 / 3, 1.0]
    assert lrs[3:] == pytest.approx(after_warmup, abs=1e-12)


@pytest.mark.parametrize("override, message", [
    ("train.schedule=wsd", r"train.schedule='wsd': choose cosine, linear or constant"),
    ("train.decay_steps=-1", r"train.decay_steps=-1 must be 0 \(decay over every step after warmup\) or more"),
    ("train.decay_steps=3 train.schedule=constant",
     r"train.decay_steps=3 decays, and train.schedule=constant does not"),
])
def test_a_schedule_sixfold_does_not_have_is_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, override.split())


def test_parameters_are_views_of_unit_buffers():
    model, _ = _models()
    sharded = _sharded(model)
    for unit in sharded.units:
        assert unit.padded % 16 == 0 and unit.padded >= sum(unit.sizes)
        for p in unit.params:
            assert p.data.untyped_storage().data_ptr() == unit.full.untyped_storage().data_ptr()
            assert p.grad.untyped_storage().data_ptr() == unit.grad.untyped_storage().data_ptr()


def test_reduced_gradients_reach_the_fp32_shard_in_every_dtype():
    """On a group of one nothing is sent, yet the gradients must land in the shard the optimizer reads, not
    rounded to grad_reduce's dtype (only what crosses the wire is)."""
    x, y = _batch(torch.Generator().manual_seed(0))
    for dtype, reduce in itertools.product((torch.float32, torch.bfloat16), repeat=2):
        model = Llama(ModelConfig())
        init_weights(model, 7)
        sharded = _sharded(model, dtype=dtype, reduce_dtype=reduce)
        model.loss_sum(x, y).backward()
        grads = [u.grad.clone() for u in sharded.units]
        sharded.finish()
        for unit, grad in zip(sharded.units, grads):
            assert unit.grad_shard.dtype == torch.float32 and grad.abs().sum() > 0
            assert torch.equal(unit.grad_shard, grad.float()), (dtype, reduce, unit.index)
