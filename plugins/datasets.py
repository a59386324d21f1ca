"""fedkit's data sets: scikit-learn's bundled digits (embedded, no download),
torchvision's CIFAR-10/100, STL-10, MNIST, EMNIST (balanced), Fashion-MNIST and SVHN from
a local ``data.root`` (fetched there with ``data.download: true``), and any ImageFolder
directory. Registered the way an outside package registers its own. Only the ImageFolder
loader reads chosen files alone (``labels`` and ``subset``); the array sets come in one
file per split, so one client's data is sliced from the whole split right after loading."""

from __future__ import annotations

from collections.abc import Callable

from fedkit import hookimpl
from fedkit.data.datasets import (
    imagefolder_labels,
    imagefolder_subset,
    load_cifar,
    load_digits,
    load_imagefolder,
    load_mnist_like,
    load_stl10,
    load_svhn,
)

FOLDER_HINT = (
    "a folder with train/<class>/ and test/<class>/ image folders; for CIFAR-10, "
    "--set data.dataset=cifar10 --set data.download=true fetches torchvision's files "
    "instead; see docs/data.md"
)


@hookimpl
def register_datasets(register: Callable[..., None]) -> None:
    register("digits", load_digits, needs_root=False)
    for name in ("cifar10", "cifar100"):
        register(name, load_cifar, download=True)
    register("stl10", load_stl10, download=True, splits=("train", "test", "unlabeled"))
    for name in ("mnist", "emnist", "fashion_mnist"):
        register(name, load_mnist_like, download=True)
    register("svhn", load_svhn, download=True)
    register(
        "imagefolder",
        load_imagefolder,
        root_hint=FOLDER_HINT,
        labels=imagefolder_labels,
        subset=imagefolder_subset,
    )
