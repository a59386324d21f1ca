"""fedkit's partitioners: ``iid``, ``dirichlet`` (label skew), ``classes_per_client``
(FedU's non-IID), ``labels_per_client`` (NIID-Bench's #C=k), ``cluster_groups`` (CP-CFL's
groups of clients sharing class sets) and
``sampled`` (a few images per client drawn at random, for populations larger than the
data set).
Registered the way an outside package registers its own."""

from __future__ import annotations

from collections.abc import Callable

from fedkit import hookimpl
from fedkit.data.partition import (
    classes_per_client,
    cluster_groups,
    dirichlet,
    iid,
    labels_per_client,
    sampled,
)


@hookimpl
def register_partitioners(register: Callable[..., None]) -> None:
    register("iid", iid)
    register("dirichlet", dirichlet)
    register("classes_per_client", classes_per_client)
    register("labels_per_client", labels_per_client)
    register("cluster_groups", cluster_groups)
    register("sampled", sampled)
