"""Behaviour checks of the SSL blocks: losses, EMA, batched augmentation, heads."""

from __future__ import annotations

import math

import pytest
import torch
import torchvision.transforms.functional as TF
from torch import nn

from fedkit.models.heads import classifier_head, mlp
from fedkit.ssl.augment import (
    TwoViewAugment,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    crop_resize_flip,
    sample_crop_boxes,
)
from fedkit.ssl.ema import copy_params, ema_update
from fedkit.ssl.losses import (
    byol_loss,
    byol_symmetric,
    nt_xent,
    simsiam_loss,
    simsiam_symmetric,
)

MEAN = (0.5, 0.4, 0.3)
STD = (0.2, 0.25, 0.3)


def _images(n: int = 6, size: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


# ---------------------------------------------------------------- losses


def test_byol_loss_matches_hand_value():
    p = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    z = torch.tensor([[1.0, 1.0], [0.0, 5.0]])
    # cosines: 1/sqrt(2) and 0  ->  losses 2 - sqrt(2) and 2
    expected = ((2 - math.sqrt(2)) + 2.0) / 2
    assert byol_loss(p, z).item() == pytest.approx(expected, abs=1e-6)
    assert simsiam_loss(p, z).item() == pytest.approx(-(1 / math.sqrt(2)) / 2, abs=1e-6)


def test_symmetric_forms_sum_and_average():
    g = torch.Generator().manual_seed(1)
    p1, p2, z1, z2 = (torch.randn(4, 5, generator=g) for _ in range(4))
    assert byol_symmetric(p1, p2, z1, z2).item() == pytest.approx(
        (byol_loss(p1, z2) + byol_loss(p2, z1)).item()
    )
    assert simsiam_symmetric(p1, p2, z1, z2).item() == pytest.approx(
        0.5 * (simsiam_loss(p1, z2) + simsiam_loss(p2, z1)).item()
    )


@pytest.mark.parametrize("loss", [byol_loss, simsiam_loss])
def test_losses_stop_gradient_into_target(loss):
    p = torch.randn(3, 4, requires_grad=True)
    z = torch.randn(3, 4, requires_grad=True)
    loss(p, z).backward()
    assert p.grad is not None and p.grad.abs().sum() > 0
    assert z.grad is None


def _nt_xent_loop(z1, z2, tau, extra=None):
    z = torch.cat([z1, z2])
    z = z / z.norm(dim=1, keepdim=True)
    bank = [] if extra is None else list(extra / extra.norm(dim=1, keepdim=True))
    n2 = z.shape[0]
    n = n2 // 2
    total = 0.0
    for i in range(n2):
        pos = (i + n) % n2
        others = [j for j in range(n2) if j != i]
        denom = sum(math.exp(float(z[i] @ z[j]) / tau) for j in others)
        denom += sum(math.exp(float(z[i] @ b) / tau) for b in bank)
        total += -math.log(math.exp(float(z[i] @ z[pos]) / tau) / denom)
    return total / n2


def test_nt_xent_matches_loop_with_and_without_extra_negatives():
    g = torch.Generator().manual_seed(2)
    z1, z2 = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    extra = torch.randn(5, 4, generator=g) * 3.0
    for tau in (0.1, 0.5):
        assert nt_xent(z1, z2, tau).item() == pytest.approx(_nt_xent_loop(z1, z2, tau), rel=1e-5)
        got = nt_xent(z1, z2, tau, extra_negatives=extra).item()
        assert got == pytest.approx(_nt_xent_loop(z1, z2, tau, extra), rel=1e-5)
    base = nt_xent(z1, z2, 0.5, extra_negatives=extra).item()
    assert nt_xent(z1, z2, 0.5, extra_negatives=-extra).item() != pytest.approx(base)
    assert nt_xent(z1, z2, 0.5).item() < base  # more negatives, larger loss


def test_nt_xent_does_not_backprop_into_dictionary():
    z1 = torch.randn(3, 4, requires_grad=True)
    extra = torch.randn(2, 4, requires_grad=True)
    nt_xent(z1, torch.randn(3, 4), extra_negatives=extra).backward()
    assert z1.grad is not None and extra.grad is None


# ---------------------------------------------------------------- EMA


def test_ema_update_math_and_buffers_untouched():
    online, target = nn.Linear(2, 1), nn.Linear(2, 1)
    bn_o, bn_t = nn.BatchNorm1d(1), nn.BatchNorm1d(1)
    with torch.no_grad():
        online.weight.copy_(torch.tensor([[1.0, 2.0]]))
        online.bias.fill_(3.0)
        target.weight.copy_(torch.tensor([[5.0, -2.0]]))
        target.bias.fill_(0.0)
        bn_o.running_mean.fill_(7.0)
    ema_update(target, online, m=0.75)
    assert torch.allclose(target.weight, torch.tensor([[4.0, -1.0]]))
    assert torch.allclose(target.bias, torch.tensor([0.75]))
    assert target.weight.is_leaf and target.weight.grad_fn is None
    ema_update(bn_t, bn_o, m=0.0)
    assert bn_t.running_mean.item() == 0.0  # buffers are not averaged


def test_copy_params_keeps_tensors_and_optionally_buffers():
    a, b = nn.BatchNorm1d(2), nn.BatchNorm1d(2)
    with torch.no_grad():
        b.weight.fill_(4.0)
        b.running_var.fill_(9.0)
    w = a.weight
    copy_params(a, b)
    assert a.weight is w and torch.equal(a.weight, b.weight)
    assert torch.equal(a.running_var, torch.ones(2))
    copy_params(a, b, buffers=True)
    assert torch.equal(a.running_var, b.running_var)
    with pytest.raises(ValueError):
        copy_params(nn.Linear(2, 2), nn.Linear(2, 3))


# ---------------------------------------------------------------- augmentation


def test_augment_shapes_dtype_and_determinism():
    aug = TwoViewAugment((12, 10), MEAN, STD)
    x = _images()
    v1, v2 = aug(x, torch.Generator().manual_seed(0))
    assert v1.shape == v2.shape == (6, 3, 12, 10)
    assert v1.dtype == v2.dtype == torch.float32
    w1, w2 = aug(x, torch.Generator().manual_seed(0))
    assert torch.equal(v1, w1) and torch.equal(v2, w2)
    assert not torch.allclose(v1, v2)
    u1, _ = aug(x, torch.Generator().manual_seed(1))
    assert not torch.allclose(v1, u1)


def test_uint8_and_float_inputs_agree():
    aug = TwoViewAugment(16, MEAN, STD)
    x = _images()
    a = aug.augment_one(x, torch.Generator().manual_seed(3))
    b = aug.augment_one(x.float() / 255, torch.Generator().manual_seed(3))
    assert torch.allclose(a, b, atol=1e-5)


def test_parameters_are_per_sample():
    aug = TwoViewAugment(16, (0, 0, 0), (1, 1, 1), jitter_p=0.0, gray_p=0.0, flip_p=0.0)
    x = _images(1).expand(4, -1, -1, -1).contiguous()
    out = aug.augment_one(x, torch.Generator().manual_seed(0))
    assert not torch.allclose(out[0], out[1])
    assert not torch.allclose(out[2], out[3])


def test_flip_only_equals_torch_flip_and_output_is_normalised():
    full = dict(scale=(1.0, 1.0), ratio=(1.0, 1.0), jitter_p=0.0, gray_p=0.0)
    x = _images()
    unit = x.float() / 255
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    flipped = TwoViewAugment(16, MEAN, STD, flip_p=1.0, **full).augment_one(x)
    assert torch.allclose(flipped, (torch.flip(unit, dims=[-1]) - mean) / std, atol=1e-4)
    plain = TwoViewAugment(16, MEAN, STD, flip_p=0.0, **full).augment_one(x)
    assert torch.allclose(plain, (unit - mean) / std, atol=1e-4)


def test_crop_without_resize_extracts_the_box():
    x = torch.rand(2, 3, 16, 16)
    boxes = torch.tensor([[2, 5, 8, 8], [0, 0, 8, 8]])
    out = crop_resize_flip(x, boxes, torch.tensor([False, True]), (8, 8))
    assert torch.allclose(out[0], x[0, :, 2:10, 5:13], atol=1e-5)
    assert torch.allclose(out[1], torch.flip(x[1, :, 0:8, 0:8], dims=[-1]), atol=1e-5)


def test_crop_boxes_in_bounds_and_scale_range():
    boxes = sample_crop_boxes(2000, 32, 32, (0.08, 1.0), (3 / 4, 4 / 3), torch.Generator())
    top, left, h, w = boxes.unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 32).all()
    assert (left + w <= 32).all() and (h > 0).all() and (w > 0).all()
    frac = (h * w).float() / 1024
    assert frac.min() > 0.05 and frac.max() <= 1.0 and 0.45 < frac.mean() < 0.6


def test_grayscale_always_gives_equal_channels():
    aug = TwoViewAugment(16, (0, 0, 0), (1, 1, 1), gray_p=1.0)
    out = aug.augment_one(_images(), torch.Generator().manual_seed(0))
    assert torch.allclose(out[:, 0], out[:, 1]) and torch.allclose(out[:, 1], out[:, 2])


def test_colour_ops_match_torchvision_tensor_ops():
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    f = torch.tensor([0.3, 1.0, 1.5, 1.8])
    for ours, ref in (
        (adjust_contrast, TF.adjust_contrast),
        (adjust_saturation, TF.adjust_saturation),
    ):
        expect = torch.stack([ref(xi, fi.item()) for xi, fi in zip(x, f, strict=True)])
        assert torch.allclose(ours(x, f), expect, atol=5e-4)
    shifts = torch.tensor([-0.4, -0.1, 0.2, 0.5])
    expect = torch.stack([TF.adjust_hue(xi, s.item()) for xi, s in zip(x, shifts, strict=True)])
    assert torch.allclose(adjust_hue(x, shifts), expect, atol=1e-5)


# ---------------------------------------------------------------- heads


def test_mlp_structure_and_sizes():
    head = mlp(512, 4096, 2048)
    kinds = [type(m) for m in head]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert head(torch.randn(2, 512)).shape == (2, 2048)
    cp = mlp(8, 16, 4, bn_last=True)
    assert isinstance(cp[-1], nn.BatchNorm1d)
    three = mlp(8, 16, 4, layers=3, bn_hidden=False)
    assert [type(m) for m in three] == [nn.Linear, nn.ReLU] * 2 + [nn.Linear]
    assert len(mlp(8, 16, 4, layers=1)) == 1


@pytest.mark.parametrize("variant,n_linear", [("c", 1), ("c-1", 2), ("c-2", 3), ("c-3", 4)])
def test_classifier_head_variants(variant, n_linear):
    head = classifier_head(32, 10, variant, hidden=16)
    assert sum(isinstance(m, nn.Linear) for m in head) == n_linear
    assert sum(isinstance(m, nn.ReLU) for m in head) == n_linear - 1
    assert head(torch.randn(3, 32)).shape == (3, 10)


def test_classifier_head_rejects_unknown_variant():
    with pytest.raises(ValueError):
        classifier_head(4, 2, "c-4")
