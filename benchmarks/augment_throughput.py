"""Throughput of the batched TwoViewAugment vs the per-image torchvision pipeline.

Both produce two normalised views of the same uint8 32×32 images with the same settings.
The torchvision side does what a CIFAR data loader does per item (``Image.fromarray`` of
an HWC array, the ``transforms.Compose`` twice) and then stacks the views into batches;
the batched side moves each uint8 batch to ``--device`` and augments it there. Timings
are wall-clock, the median over ``--repeats`` after one warm-up pass.

    OMP_NUM_THREADS=1 python benchmarks/augment_throughput.py --n 2048 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from PIL import Image
from torch import Tensor
from torchvision import transforms
from torchvision.transforms import functional as TF

from fedkit.ssl.augment import TwoViewAugment, _pair


class TorchvisionTwoView:
    """Per-image torchvision pipeline applied twice; a plain class so it pickles for workers.

    Accepts a PIL image or a 3×H×W uint8 tensor (converted to PIL first).
    """

    def __init__(self, transform: Callable[[Image.Image], Tensor]) -> None:
        self.transform = transform

    def __call__(self, img: Image.Image | Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(img, Tensor):
            img = TF.to_pil_image(img)
        return self.transform(img), self.transform(img)


def torchvision_two_view(
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
) -> TorchvisionTwoView:
    """The standard per-image ``transforms.Compose`` with ``TwoViewAugment``'s settings:
    the reference this benchmark times it against."""
    pipeline = transforms.Compose(
        [
            transforms.RandomResizedCrop(_pair(size), scale=scale, ratio=ratio),
            transforms.RandomHorizontalFlip(p=flip_p),
            transforms.RandomApply([transforms.ColorJitter(*jitter)], p=jitter_p),
            transforms.RandomGrayscale(p=gray_p),
            transforms.ToTensor(),
            transforms.Normalize(mean, std),
        ]
    )
    return TorchvisionTwoView(pipeline)


MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], None], repeats: int, device: torch.device) -> list[float]:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048, help="images per pass")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="device of the batched augmentation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    images = torch.randint(0, 256, (args.n, 3, args.size, args.size), generator=g)
    images = images.to(torch.uint8)
    arrays = images.permute(0, 2, 3, 1).contiguous().numpy()
    batched = TwoViewAugment(args.size, MEAN, STD)
    per_image = torchvision_two_view(args.size, MEAN, STD)
    bs = args.batch_size

    def run_batched() -> None:
        for start in range(0, args.n, bs):
            batched(images[start : start + bs].to(device, non_blocking=True), g)

    def run_torchvision() -> None:
        for start in range(0, args.n, bs):
            views = [per_image(Image.fromarray(a)) for a in arrays[start : start + bs]]
            torch.stack([v[0] for v in views]), torch.stack([v[1] for v in views])

    rows = [
        (f"TwoViewAugment (batched, {device})", _time(run_batched, args.repeats, device)),
        ("torchvision Compose (per image, cpu)", _time(run_torchvision, args.repeats, device)),
    ]
    print(
        f"{args.n} images of {args.size}x{args.size} uint8, batch {bs}, two views each, "
        f"median of {args.repeats} (torch threads: {torch.get_num_threads()})"
    )
    print(f"{'pipeline':<40} {'median s':>9} {'images/s':>10} {'vs torchvision':>15}")
    ref = statistics.median(rows[1][1])
    for name, times in rows:
        med = statistics.median(times)
        print(f"{name:<40} {med:>9.3f} {args.n / med:>10.0f} {ref / med:>14.2f}x")


if __name__ == "__main__":
    main()
