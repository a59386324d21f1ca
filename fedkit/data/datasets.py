"""Image data sets loaded whole into memory as uint8 tensors.

Federated runs index the same images many times per round, so every split is decoded
once into an ``N×3×H×W`` uint8 tensor (4× smaller than float) and normalised per batch.
Grayscale sets are replicated to three channels so any backbone fits every data set.
Data sets are found by name among what plugins register (``register_datasets``); the
loaders below are fedkit's own, registered by its ``datasets`` plugin.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fedkit.config.schema import DataConfig
from fedkit.data.normalization import standardize
from fedkit.errors import FedkitError, RecipeError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
STL10_CLASSES = "airplane bird car cat deer dog horse monkey ship truck".split()
_RESIZE_CHUNK = 4096

Triple = tuple[float, float, float]
Stats = tuple[Triple, Triple]


@dataclass
class ImageSet:
    """Images (uint8, N×3×H×W), labels (int64, -1 when unlabelled) and normalisation stats."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    mean: Triple
    std: Triple

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def subset(self, idx) -> ImageSet:
        """The images at ``idx`` (a copy), sharing classes and normalisation stats."""
        idx = _index(idx)
        return ImageSet(self.images[idx], self.labels[idx], self.classes, self.mean, self.std)

    def normalized(self, idx=None, device=None) -> torch.Tensor:
        """Float32 ``(x/255 - mean)/std`` for ``idx`` (all when None), on ``device``.

        The uint8 images move to the device before conversion, so a transfer costs a
        quarter of the float one.
        """
        x = self.images if idx is None else self.images[_index(idx)]
        return standardize(x.to(device), self.mean, self.std)


def _index(idx) -> torch.Tensor:
    """Indices or a boolean mask (list, array or tensor) as a CPU int64 index tensor."""
    array = idx.cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
    if array.dtype == np.bool_:
        array = np.flatnonzero(array)
    return torch.from_numpy(array.astype(np.int64, copy=False).reshape(-1))


@dataclass
class RawImages:
    """What a data set's loader returns for one split: uint8 images (``N×3×H×W``, or
    ``N×H×W`` grayscale), int64 labels and the class names."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]


@dataclass(frozen=True)
class Dataset:
    """A registered data set (the ``register_datasets`` hook): ``load(cfg, split, limit)``
    returns ``RawImages``; ``needs_root``: ``data.root`` must name a directory;
    ``download``: ``data.download: true`` may fetch the files into it; ``splits`` it has;
    ``root_hint``: how to get the files, for the error when they are missing.

    ``labels(cfg, split)`` and ``subset(cfg, split, indices)``, given together or not at
    all, let one client's data be read alone (``fedkit.data.build_client_data``): the
    first returns every label of the split without decoding an image, the second only the
    images at ``indices`` (positions in the order of ``load(cfg, split, None)``, in that
    order, repeats allowed) as ``RawImages``. Such a data set's ``load`` must keep
    ``balanced_subset(labels, limit)`` for a ``limit``, or ignore it. Without them the
    split is loaded whole once and sliced at once."""

    load: Callable[[DataConfig, str, int | None], RawImages]
    needs_root: bool = True
    download: bool = False
    splits: tuple[str, ...] = ("train", "test")
    root_hint: str = ""
    labels: Callable[[DataConfig, str], Any] | None = None
    subset: Callable[[DataConfig, str, np.ndarray], RawImages] | None = None

    def __post_init__(self) -> None:
        if (self.labels is None) != (self.subset is None):
            raise ValueError("a data set registers both labels and subset, or neither")

    @property
    def reads_subsets(self) -> bool:
        """Whether chosen images can be read without loading the whole split."""
        return self.labels is not None and self.subset is not None


def load_split(cfg: DataConfig, split: str, dataset: Dataset) -> ImageSet:
    """Load one split of ``dataset`` for the recipe section ``cfg``.

    Normalisation stats always come from the train split, so train and test of one data
    set are normalised identically; loading "test" alone therefore also reads the train
    split (use ``load_splits`` to read both once).
    """
    if split not in dataset.splits:
        raise ValueError(f"split must be one of {dataset.splits}, not {split!r}")
    train = _load_limited(cfg, "train", dataset)
    if split == "train":
        return _with_stats(train, input_stats(cfg, train))
    return _with_stats(_load_limited(cfg, split, dataset), input_stats(cfg, train))


def load_splits(cfg: DataConfig, dataset: Dataset) -> tuple[ImageSet, ImageSet]:
    """Load the train and test splits of ``dataset`` with the train split's stats."""
    train = _load_limited(cfg, "train", dataset)
    stats = input_stats(cfg, train)
    return _with_stats(train, stats), _with_stats(_load_limited(cfg, "test", dataset), stats)


def check_data(cfg: DataConfig, dataset: Dataset) -> None:
    """The files a recipe's data section needs are where it says (before any work)."""
    if not dataset.needs_root or (dataset.download and cfg.download):
        return
    if cfg.root is None:
        expected = f"a directory holding the {cfg.dataset} files"
        raise RecipeError("data.root", expected, None, hint=_root_hint(cfg, dataset))
    if not Path(cfg.root).expanduser().is_dir():
        raise RecipeError(
            "data.root", "an existing directory", cfg.root, hint=_root_hint(cfg, dataset)
        )


def _root_hint(cfg: DataConfig, dataset: Dataset) -> str:
    if dataset.root_hint:
        return f" ({dataset.root_hint})"
    if dataset.download:
        return f" (set data.download: true to fetch {cfg.dataset} there; see docs/data.md)"
    return " (see docs/data.md)"


def balanced_subset(labels: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """Sorted indices of ``n`` items spread over the classes as evenly as they allow.

    Items are ranked within their class in a seeded random order and taken rank by rank
    across classes, so a small class gives all it has and the rest come from the others.
    """
    labels = np.asarray(labels)
    if n >= len(labels):
        return np.arange(len(labels))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    shuffled = labels[order]
    rank = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        members = np.flatnonzero(shuffled == c)
        rank[members] = np.arange(len(members))
    picked = order[np.lexsort((shuffled, rank))[:n]]
    return np.sort(picked)


def _load_limited(cfg: DataConfig, split: str, dataset: Dataset) -> RawImages:
    """Load a split, keeping a class-balanced subset when ``max_train``/``max_test`` is
    set, as RGB images of ``cfg.image_size``."""
    limit = _limit(cfg, split)
    raw = dataset.load(cfg, split, limit)
    images, labels = raw.images, raw.labels
    if limit is not None and limit < len(labels):
        keep = torch.from_numpy(balanced_subset(labels.numpy(), limit))
        images, labels = images[keep], labels[keep]
    return RawImages(_rgb_sized(images, cfg.image_size), labels, raw.classes)


def _limit(cfg: DataConfig, split: str) -> int | None:
    return cfg.max_test if split == "test" else cfg.max_train


def _rgb_sized(images: torch.Tensor, size: int) -> torch.Tensor:
    """Loader output (``N×3×H×W`` or grayscale ``N×H×W``) as RGB ``N×3×size×size``."""
    return _resize(_to_rgb(images) if images.dim() == 3 else images, size)


class LabelledSplit:
    """One split of a data set, as ``load_split`` would keep it (``max_train``/``max_test``
    applied), known by its labels, whose images are read only when asked for.

    With a data set that reads subsets (``Dataset.labels`` and ``Dataset.subset``) no
    image is decoded until ``images``; otherwise the split is loaded whole here, and
    ``images`` copies the chosen ones out (drop this object to free the rest).
    """

    def __init__(self, cfg: DataConfig, split: str, dataset: Dataset) -> None:
        if split not in dataset.splits:
            raise ValueError(f"split must be one of {dataset.splits}, not {split!r}")
        self.cfg, self.split, self.dataset = cfg, split, dataset
        limit = _limit(cfg, split)
        self._whole: RawImages | None = None
        if dataset.reads_subsets:
            assert dataset.labels is not None
            every = np.asarray(dataset.labels(cfg, split), dtype=np.int64).reshape(-1)
        else:
            self._whole = dataset.load(cfg, split, limit)
            every = self._whole.labels.numpy()
        self._kept = None
        if limit is not None and limit < len(every):
            self._kept = balanced_subset(every, limit)
            every = every[self._kept]
        self.labels: np.ndarray = every

    def images(self, positions: np.ndarray) -> RawImages:
        """The images at ``positions`` of ``labels`` (in that order), RGB at
        ``data.image_size``; the images and labels are copies."""
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        where = positions if self._kept is None else self._kept[positions]
        if self._whole is not None:
            index, whole = torch.from_numpy(where), self._whole
            raw = RawImages(whole.images[index], whole.labels[index], whole.classes)
        else:
            assert self.dataset.subset is not None
            raw = self.dataset.subset(self.cfg, self.split, where)
            if not np.array_equal(np.asarray(raw.labels), self.labels[positions]):
                raise FedkitError(
                    f"data set {self.cfg.dataset!r}: the labels its subset loader returns for "
                    f"the {self.split} split differ from those its labels loader gave"
                )
        return RawImages(_rgb_sized(raw.images, self.cfg.image_size), raw.labels, raw.classes)


UNSCALED: Stats = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
"""The statistics that leave inputs on the 0..1 scale (``data.standardize: false``)."""


def input_stats(cfg: DataConfig, train: RawImages) -> Stats:
    """What every loop standardises inputs with: the train split's per-channel mean and
    std, or ``UNSCALED`` when the recipe keeps images on the 0..1 scale (as benchmarks
    that feed ``ToTensor()`` output do, NIID-Bench's among them)."""
    return _stats(train) if cfg.standardize else UNSCALED


def _stats(raw: RawImages) -> Stats:
    """Per-channel mean and std on the 0..1 scale, from exact value histograms."""
    values = torch.arange(256, dtype=torch.float64) / 255.0
    mean, std = [], []
    for c in range(3):
        hist = torch.bincount(raw.images[:, c].reshape(-1), minlength=256).double()
        p = hist / hist.sum().clamp_min(1.0)
        m = float((p * values).sum())
        mean.append(m)
        std.append(max(float((p * (values - m) ** 2).sum()), 1e-12) ** 0.5)
    return (mean[0], mean[1], mean[2]), (std[0], std[1], std[2])


def _with_stats(raw: RawImages, stats: Stats) -> ImageSet:
    return ImageSet(raw.images, raw.labels, raw.classes, *stats)


def _resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """Bilinear (antialiased) resize of uint8 N×3×H×W images to size×size, in chunks."""
    if images.shape[-2:] == (size, size):
        return images.contiguous()
    out = torch.empty((images.shape[0], 3, size, size), dtype=torch.uint8)
    for start in range(0, images.shape[0], _RESIZE_CHUNK):
        chunk = images[start : start + _RESIZE_CHUNK].float()
        resized = F.interpolate(
            chunk, size=(size, size), mode="bilinear", align_corners=False, antialias=True
        )
        out[start : start + _RESIZE_CHUNK] = resized.round_().clamp_(0, 255).to(torch.uint8)
    return out


def _to_rgb(images: torch.Tensor) -> torch.Tensor:
    """N×H×W grayscale to N×3×H×W by replicating the channel."""
    return images.unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def load_digits(cfg: DataConfig, split: str, limit: int | None = None) -> RawImages:
    """scikit-learn's bundled 8×8 digits, split 80/20 stratified with seed 0."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = torch.from_numpy(np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8))
    labels = bunch.target.astype(np.int64)
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)), test_size=0.2, stratify=labels, random_state=0
    )
    idx = torch.from_numpy(np.sort(train_idx if split == "train" else test_idx))
    classes = [str(c) for c in bunch.target_names]
    return RawImages(images[idx], torch.from_numpy(labels)[idx], classes)


def _torchvision(cfg: DataConfig, factory: Callable[[str], Any]) -> Any:
    """Build a torchvision data set; missing files and failed downloads become RecipeErrors."""
    expected = f"a directory holding the {cfg.dataset} files (or set data.download: true)"
    if cfg.root is None or (not cfg.download and not Path(cfg.root).expanduser().is_dir()):
        raise RecipeError("data.root", expected, cfg.root)
    try:
        return factory(str(Path(cfg.root).expanduser()))
    except RuntimeError as exc:
        if cfg.download:
            raise
        raise RecipeError("data.root", expected, cfg.root, hint=f" ({exc})") from None
    except OSError as exc:
        if not cfg.download:
            raise
        raise RecipeError(
            "data.download",
            f"a reachable download of {cfg.dataset} (or its files already in data.root)",
            hint=f" ({exc})",
        ) from None


def load_cifar(cfg: DataConfig, split: str, limit: int | None = None) -> RawImages:
    """torchvision's CIFAR-10 or CIFAR-100 (by ``cfg.dataset``) from ``cfg.root``."""
    from torchvision import datasets

    cls = datasets.CIFAR10 if cfg.dataset == "cifar10" else datasets.CIFAR100
    ds = _torchvision(cfg, lambda root: cls(root, train=split == "train", download=cfg.download))
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2)
    return RawImages(images, torch.as_tensor(ds.targets, dtype=torch.int64), list(ds.classes))


def load_stl10(cfg: DataConfig, split: str, limit: int | None = None) -> RawImages:
    """torchvision's STL-10 (train, test, unlabeled) from ``cfg.root``."""
    from torchvision import datasets

    ds = _torchvision(cfg, lambda root: datasets.STL10(root, split=split, download=cfg.download))
    classes = list(getattr(ds, "classes", STL10_CLASSES))
    labels = torch.from_numpy(ds.labels.astype(np.int64))
    return RawImages(torch.from_numpy(ds.data), labels, classes)


def load_svhn(cfg: DataConfig, split: str, limit: int | None = None) -> RawImages:
    """torchvision's SVHN from ``cfg.root``."""
    from torchvision import datasets

    ds = _torchvision(cfg, lambda root: datasets.SVHN(root, split=split, download=cfg.download))
    labels = torch.from_numpy(ds.labels.astype(np.int64))
    return RawImages(torch.from_numpy(ds.data), labels, [str(c) for c in range(10)])


def load_mnist_like(cfg: DataConfig, split: str, limit: int | None = None) -> RawImages:
    """MNIST, Fashion-MNIST and EMNIST (balanced; stored transposed, so turned upright)."""
    from torchvision import datasets

    train = split == "train"
    if cfg.dataset == "emnist":
        ds = _torchvision(
            cfg,
            lambda root: datasets.EMNIST(
                root, split="balanced", train=train, download=cfg.download
            ),
        )
        images = ds.data.transpose(1, 2)
    else:
        cls = datasets.MNIST if cfg.dataset == "mnist" else datasets.FashionMNIST
        ds = _torchvision(cfg, lambda root: cls(root, train=train, download=cfg.download))
        images = ds.data
    return RawImages(images, ds.targets.to(torch.int64), list(ds.classes))


def _folder_split(cfg: DataConfig, split: str) -> Path:
    """The directory of one split: ``root/<split>``, or root itself as train when flat."""
    if cfg.root is None or not Path(cfg.root).expanduser().is_dir():
        raise RecipeError(
            "data.root", "a directory of class folders (ImageFolder layout)", cfg.root
        )
    root = Path(cfg.root).expanduser()
    if (root / split).is_dir():
        return root / split
    if split == "train" and not (root / "test").is_dir():
        return root
    raise RecipeError(
        "data.root",
        f"a directory with a {split}/ subfolder of class folders (ImageFolder layout)",
        cfg.root,
    )


def _class_dirs(directory: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(directory) if e.is_dir())


def _list_images(directory: Path, classes: list[str]) -> tuple[list[str], np.ndarray]:
    """Image paths (sorted within each class) and their label indices."""
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        folder = directory / name
        if not folder.is_dir():
            continue
        files = sorted(
            e.path
            for e in os.scandir(folder)
            if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS)
        )
        paths += files
        labels += [label] * len(files)
    return paths, np.asarray(labels, dtype=np.int64)


def _read_image(path: str, size: int) -> np.ndarray:
    """One image file as an RGB size×size×3 uint8 array (PIL bilinear resize if needed)."""
    with Image.open(path) as image:
        if image.mode != "RGB":
            image = image.convert("RGB")
        if image.size != (size, size):
            image = image.resize((size, size), Image.Resampling.BILINEAR)
        return np.asarray(image)


def _folder_listing(cfg: DataConfig, split: str) -> tuple[list[str], np.ndarray, list[str]]:
    """An ImageFolder split's image paths, their labels and the classes (the train split's
    folders), from directory listings alone."""
    classes = _class_dirs(_folder_split(cfg, "train"))
    directory = _folder_split(cfg, split)
    unknown = sorted(set(_class_dirs(directory)) - set(classes))
    if unknown:
        raise RecipeError(
            "data.root",
            f"the same class folders in {split}/ as in train/",
            str(directory),
            hint=f" (not in train/: {', '.join(unknown)})",
        )
    paths, labels = _list_images(directory, classes)
    if not paths:
        raise RecipeError("data.root", f"image files in class folders of {directory}", cfg.root)
    return paths, labels, classes


def _decode(paths: list[str], size: int) -> torch.Tensor:
    """Image files as uint8 ``N×3×size×size``; an unreadable one is a ``RecipeError``."""
    images = np.empty((len(paths), size, size, 3), dtype=np.uint8)
    for i, path in enumerate(paths):
        try:
            images[i] = _read_image(path, size)
        except OSError as exc:
            raise RecipeError("data.root", "readable image files", path, hint=f" ({exc})") from None
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()


def load_imagefolder(cfg: DataConfig, split: str, limit: int | None = None) -> RawImages:
    """Decode an ImageFolder split into memory; classes are the train split's folders.

    The subset for ``limit`` is chosen from the file list, so only kept files are decoded.
    """
    paths, labels, classes = _folder_listing(cfg, split)
    if limit is not None and limit < len(paths):
        keep = balanced_subset(labels, limit)
        paths, labels = [paths[i] for i in keep], labels[keep]
    return RawImages(_decode(paths, cfg.image_size), torch.from_numpy(labels), classes)


def imagefolder_labels(cfg: DataConfig, split: str) -> np.ndarray:
    """Every label of an ImageFolder split, in ``load_imagefolder``'s order, from the
    folder names alone (no file is opened)."""
    return _folder_listing(cfg, split)[1]


def imagefolder_subset(cfg: DataConfig, split: str, indices: np.ndarray) -> RawImages:
    """Decode only the files at ``indices`` of an ImageFolder split's file list."""
    paths, labels, classes = _folder_listing(cfg, split)
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    chosen = [paths[i] for i in indices]
    return RawImages(_decode(chosen, cfg.image_size), torch.from_numpy(labels[indices]), classes)
