"""Data: in-memory image sets, data-set loaders, partitioners and the federated split."""

from fedkit.data.datasets import (
    Dataset,
    ImageSet,
    RawImages,
    balanced_subset,
    check_data,
    load_split,
    load_splits,
)
from fedkit.data.federated import (
    ClientData,
    FederatedData,
    build_client_data,
    build_federated_data,
    split_federated,
)
from fedkit.data.partition import Partition, partition
from fedkit.data.summary import partition_table, render_partition, save_partition

__all__ = [
    "ClientData",
    "Dataset",
    "FederatedData",
    "ImageSet",
    "Partition",
    "RawImages",
    "balanced_subset",
    "build_client_data",
    "build_federated_data",
    "check_data",
    "load_split",
    "load_splits",
    "partition",
    "partition_table",
    "render_partition",
    "save_partition",
    "split_federated",
]
