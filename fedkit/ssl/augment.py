"""Two-view augmentation for contrastive learning, applied to a whole batch at once.

``TwoViewAugment`` draws every random parameter per sample on a CPU ``torch.Generator``
(so a seeded generator reproduces the same views on any device) and then applies the ops
as batched tensor maths on the batch's own device. Ops, in torchvision's order:

1. RandomResizedCrop: torchvision's box sampling (10 tries of scale × log-uniform ratio,
   then a centre-crop fallback), resampled bilinearly with ``affine_grid``/``grid_sample``
   (half-pixel centres, border padding). Unlike torchvision there is no antialiasing when
   a crop is shrunk; for 32×32 crops to 32×32 output every crop is enlarged, so this
   only matters for large inputs.
2. Horizontal flip, folded into the same affine transform.
3. ColorJitter (brightness, contrast, saturation, hue) with probability ``jitter_p``;
   the four ops run in a random order per sample, as in torchvision. Hue is shifted in
   HSV space: an exact, vectorised RGB→HSV→RGB round trip (the maths of torchvision's
   tensor ``adjust_hue``), not a YIQ rotation.
4. Grayscale with probability ``gray_p`` (ITU-R 601 luma, copied to three channels).
5. Normalisation with ``mean``/``std``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_LUMA = (0.299, 0.587, 0.114)
_CROP_TRIES = 10
# For each RGB output channel, which of (v, q, p, t) it takes in each of the six hue sectors.
_HSV_SECTOR_TABLE = torch.tensor(
    [[0, 3, 2], [1, 0, 2], [2, 0, 3], [2, 1, 0], [3, 2, 0], [0, 2, 1]], dtype=torch.long
)


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    h, w = size
    return int(h), int(w)


def to_unit_float(x: Tensor) -> Tensor:
    """uint8 images → float32 in [0, 1]; floating images are returned unchanged."""
    if x.dtype == torch.uint8:
        return x.float().div_(255.0)
    if not x.is_floating_point():
        raise TypeError(f"images must be uint8 or floating point, got {x.dtype}")
    return x


def grayscale(x: Tensor) -> Tensor:
    """Luma of an (..., 3, H, W) RGB tensor, shape (..., 1, H, W)."""
    r, g, b = x.unbind(-3)
    return (_LUMA[0] * r + _LUMA[1] * g + _LUMA[2] * b).unsqueeze(-3)


def _per_sample(f: Tensor) -> Tensor:
    return f.view(-1, 1, 1, 1)


def adjust_brightness(x: Tensor, factor: Tensor) -> Tensor:
    """Scale intensities by a per-sample factor (N,), clamped to [0, 1]."""
    return (x * _per_sample(factor)).clamp_(0.0, 1.0)


def adjust_contrast(x: Tensor, factor: Tensor) -> Tensor:
    """Blend each image with its mean luma by a per-sample factor (N,)."""
    mean = grayscale(x).mean(dim=(-3, -2, -1), keepdim=True)
    f = _per_sample(factor)
    return (f * x + (1.0 - f) * mean).clamp_(0.0, 1.0)


def adjust_saturation(x: Tensor, factor: Tensor) -> Tensor:
    """Blend each image with its own grayscale version by a per-sample factor (N,)."""
    f = _per_sample(factor)
    return (f * x + (1.0 - f) * grayscale(x)).clamp_(0.0, 1.0)


def rgb_to_hsv(x: Tensor) -> Tensor:
    """(..., 3, H, W) RGB in [0, 1] → HSV with hue in [0, 1)."""
    r, g, b = x.unbind(-3)
    maxc = x.amax(dim=-3)
    minc = x.amin(dim=-3)
    delta = maxc - minc
    sat = delta / torch.where(maxc > 0, maxc, torch.ones_like(maxc))
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    rc, gc, bc = (maxc - r) / safe, (maxc - g) / safe, (maxc - b) / safe
    hue = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    hue = torch.where(delta > 0, hue, torch.zeros_like(hue))
    hue = torch.remainder(hue / 6.0, 1.0)
    return torch.stack([hue, sat, maxc], dim=-3)


def hsv_to_rgb(x: Tensor) -> Tensor:
    """Inverse of :func:`rgb_to_hsv`."""
    h, s, v = x.unbind(-3)
    h6 = h * 6.0
    sector_float = torch.floor(h6)
    frac = h6 - sector_float
    sector = torch.remainder(sector_float.long(), 6)
    p = v * (1.0 - s)
    q = v * (1.0 - s * frac)
    t = v * (1.0 - s * (1.0 - frac))
    candidates = torch.stack([v, q, p, t], dim=-3)
    pick = _HSV_SECTOR_TABLE.to(x.device)[sector].movedim(-1, -3)
    return candidates.gather(-3, pick)


def adjust_hue(x: Tensor, shift: Tensor) -> Tensor:
    """Rotate hue by a per-sample shift (N,) in turns, via HSV."""
    hsv = rgb_to_hsv(x)
    h = torch.remainder(hsv[:, 0] + shift.view(-1, 1, 1), 1.0)
    return hsv_to_rgb(torch.stack([h, hsv[:, 1], hsv[:, 2]], dim=1))


_JITTER_OPS: tuple[Callable[[Tensor, Tensor], Tensor], ...] = (
    adjust_brightness,
    adjust_contrast,
    adjust_saturation,
    adjust_hue,
)


def _uniform(n: int, low: float, high: float, g: torch.Generator | None) -> Tensor:
    return low + (high - low) * torch.rand(n, generator=g)


def sample_crop_boxes(
    n: int,
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator | None = None,
) -> Tensor:
    """Per-sample RandomResizedCrop boxes (N, 4) as integer (top, left, h, w), on CPU.

    Same distribution as torchvision: up to 10 tries of area ∈ scale·H·W and
    log-uniform aspect ratio, else a centre crop with the ratio clamped into range.
    """
    area = height * width
    target = area * (
        scale[0] + (scale[1] - scale[0]) * torch.rand(n, _CROP_TRIES, generator=generator)
    )
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    aspect = torch.exp(lo + (hi - lo) * torch.rand(n, _CROP_TRIES, generator=generator))
    cw = torch.round(torch.sqrt(target * aspect))
    ch = torch.round(torch.sqrt(target / aspect))
    ok = (cw > 0) & (cw <= width) & (ch > 0) & (ch <= height)
    first = ok.to(torch.uint8).argmax(dim=1, keepdim=True)
    cw = cw.gather(1, first).squeeze(1)
    ch = ch.gather(1, first).squeeze(1)
    u_top = torch.rand(n, generator=generator)
    u_left = torch.rand(n, generator=generator)
    top = torch.floor(u_top * (height - ch + 1))
    left = torch.floor(u_left * (width - cw + 1))

    in_ratio = width / height
    if in_ratio < min(ratio):
        fw, fh = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        fw, fh = round(height * max(ratio)), height
    else:
        fw, fh = width, height
    fallback = ~ok.any(dim=1)
    ch = torch.where(fallback, torch.tensor(float(fh)), ch)
    cw = torch.where(fallback, torch.tensor(float(fw)), cw)
    top = torch.where(fallback, torch.tensor(float((height - fh) // 2)), top)
    left = torch.where(fallback, torch.tensor(float((width - fw) // 2)), left)
    return torch.stack([top, left, ch, cw], dim=1).long()


def crop_resize_flip(x: Tensor, boxes: Tensor, flip: Tensor, size: tuple[int, int]) -> Tensor:
    """Crop per-sample boxes (top, left, h, w), resize bilinearly to ``size``, flip where set.

    One affine map per sample: output pixel centres are spread evenly over the crop box
    (half-pixel convention, like ``interpolate(align_corners=False)``).
    """
    n, _, height, width = x.shape
    b = boxes.to(torch.float64)
    top, left, ch, cw = b.unbind(1)
    sx = cw / width
    sy = ch / height
    cx = (2.0 * left + cw) / width - 1.0
    cy = (2.0 * top + ch) / height - 1.0
    sx = torch.where(flip, -sx, sx)
    zero = torch.zeros_like(sx)
    theta = torch.stack([torch.stack([sx, zero, cx], 1), torch.stack([zero, sy, cy], 1)], 1)
    theta = theta.to(device=x.device, dtype=x.dtype)
    grid = F.affine_grid(theta, [n, x.shape[1], size[0], size[1]], align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


class TwoViewAugment(nn.Module):
    """Batched two-view augmentation (crop, flip, colour jitter, grayscale, normalise).

    ``jitter`` is the (brightness, contrast, saturation, hue) strength: factors are drawn
    from [max(0, 1−s), 1+s] and the hue shift from [−h, h]. The default (0.8, 0.8, 0.8, 0.2)
    is the BYOL family's setting (the BYOL tutorial page); (0.4, 0.4, 0.4,
    0.1) is the common torchvision/SimCLR-CIFAR one. Input: N×3×H×W uint8 or float in
    [0, 1], any device. Output: float views (float32 for uint8 input), normalised, on the
    input's device.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        mean: Sequence[float],
        std: Sequence[float],
        scale: tuple[float, float] = (0.08, 1.0),
        jitter: tuple[float, float, float, float] = (0.8, 0.8, 0.8, 0.2),
        jitter_p: float = 0.8,
        gray_p: float = 0.2,
        flip_p: float = 0.5,
        *,
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        jitter_random_order: bool = True,
    ) -> None:
        super().__init__()
        if len(mean) != 3 or len(std) != 3:
            raise ValueError("mean and std need three (RGB) values")
        if not 0 < scale[0] <= scale[1]:
            raise ValueError(f"scale must satisfy 0 < low <= high, got {scale}")
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {ratio}")
        if len(jitter) != 4 or min(jitter) < 0 or jitter[3] > 0.5:
            raise ValueError(f"jitter needs 4 non-negative strengths, hue <= 0.5, got {jitter}")
        for name, p in (("jitter_p", jitter_p), ("gray_p", gray_p), ("flip_p", flip_p)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} must be a probability, got {p}")
        self.size = _pair(size)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.jitter = tuple(float(j) for j in jitter)
        self.jitter_p = float(jitter_p)
        self.gray_p = float(gray_p)
        self.flip_p = float(flip_p)
        self.jitter_random_order = jitter_random_order
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32), persistent=False)

    def _jitter_factors(self, n: int, g: torch.Generator | None) -> list[Tensor | None]:
        factors: list[Tensor | None] = []
        for s in self.jitter[:3]:
            factors.append(_uniform(n, max(0.0, 1.0 - s), 1.0 + s, g) if s > 0 else None)
        h = self.jitter[3]
        factors.append(_uniform(n, -h, h, g) if h > 0 else None)
        return factors

    def _color_jitter(self, x: Tensor, g: torch.Generator | None) -> Tensor:
        n = x.shape[0]
        apply = torch.rand(n, generator=g) < self.jitter_p
        factors = self._jitter_factors(n, g)
        if self.jitter_random_order:
            order = torch.rand(n, 4, generator=g).argsort(dim=1)
        else:
            order = torch.arange(4).expand(n, 4)
        rows = apply.nonzero().squeeze(1)
        if rows.numel() == 0 or all(f is None for f in factors):
            return x
        y = x[rows.to(x.device)]
        order = order[rows]
        for stage in range(4):
            for op, factor in enumerate(factors):
                if factor is None:
                    continue
                sel = (order[:, stage] == op).nonzero().squeeze(1)
                if sel.numel() == 0:
                    continue
                f = factor[rows[sel]].to(device=x.device, dtype=x.dtype)
                sel_dev = sel.to(x.device)
                y.index_copy_(0, sel_dev, _JITTER_OPS[op](y[sel_dev], f))
        return x.index_copy(0, rows.to(x.device), y)

    def augment_one(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One augmented, normalised view of every image in the batch ``x`` (N×3×H×W)."""
        if x.dim() != 4 or x.shape[1] != 3:
            raise ValueError(f"expected an N×3×H×W batch, got shape {tuple(x.shape)}")
        x = to_unit_float(x)
        n, _, height, width = x.shape
        g = generator
        boxes = sample_crop_boxes(n, height, width, self.scale, self.ratio, g)
        flip = torch.rand(n, generator=g) < self.flip_p
        out = crop_resize_flip(x, boxes, flip, self.size)
        out = self._color_jitter(out, g)
        gray = (torch.rand(n, generator=g) < self.gray_p).to(x.device).view(-1, 1, 1, 1)
        out = torch.where(gray, grayscale(out).expand_as(out), out)
        mean = self.mean.to(device=out.device, dtype=out.dtype).view(1, 3, 1, 1)
        std = self.std.to(device=out.device, dtype=out.dtype).view(1, 3, 1, 1)
        return (out - mean) / std

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Two independently augmented views of the batch ``x``."""
        return self.augment_one(x, generator), self.augment_one(x, generator)
