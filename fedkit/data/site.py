"""A real site's own data: one client's images from a local ImageFolder.

In a deployment, a node started with ``fedkit deploy node --data DIR`` trains on DIR
instead of a partition of the recipe's data set. DIR is an ImageFolder: class folders of
images, either directly (then ``data.local_test_size`` of them, at most half, drawn per
class from the recipe's seed, are the local test set) or under ``train/`` and ``test/``.
Class folders are matched by name to the federation's classes, which the server sends
with the run's setup together with the normalisation statistics every client
standardises with, so that every site feeds the shared model the same input scale. A
folder whose name is not one of the federation's classes is refused, naming it; a class
the site lacks is fine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedkit.config.schema import DataConfig
from fedkit.data.datasets import ImageSet, Triple, load_imagefolder
from fedkit.data.federated import ClientData, class_members, local_test_indices
from fedkit.errors import RecipeError
from fedkit.seeding import derive


def load_site(
    root: Path,
    cfg: DataConfig,
    client: int,
    classes: Sequence[str],
    mean: Triple,
    std: Triple,
    seed: int,
) -> ClientData:
    """Client ``client``'s data from the ImageFolder at ``root`` (see the module
    docstring), at the recipe's ``data.image_size``."""
    if not root.is_dir():
        raise RecipeError("--data", "a directory of class folders (ImageFolder layout)", root)
    local = cfg.model_copy(update={"root": str(root)})
    train = _as_federation(load_imagefolder(local, "train"), root, classes, mean, std)
    if (root / "test").is_dir():
        test = _as_federation(load_imagefolder(local, "test"), root / "test", classes, mean, std)
        return ClientData(client, train, test)
    rng = np.random.default_rng(derive(seed, "site-test", client))
    labels = train.labels.numpy()
    size = min(cfg.local_test_size, len(labels) // 2)
    held = local_test_indices(labels, class_members(labels), size, rng)
    kept = np.setdiff1d(np.arange(len(labels)), held)
    return ClientData(client, train.subset(kept), train.subset(held))


def _as_federation(raw, where: Path, classes: Sequence[str], mean: Triple, std: Triple) -> ImageSet:
    """The site's images with labels renumbered to the federation's class list."""
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted(set(raw.classes) - set(index))
    if unknown:
        raise RecipeError(
            "--data",
            f"class folders named as the federation's classes ({', '.join(classes)})",
            where,
            hint=f" (not a class of the federation: {', '.join(unknown)})",
        )
    mapping = torch.tensor([index[name] for name in raw.classes], dtype=torch.int64)
    return ImageSet(raw.images, mapping[raw.labels], list(classes), tuple(mean), tuple(std))
