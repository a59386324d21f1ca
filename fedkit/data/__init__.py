"""Data: in-memory image sets, partitioners and the federated split of a data set."""

from fedkit.data.datasets import DATASETS, ImageSet, balanced_subset, load_split, load_splits
from fedkit.data.federated import FederatedData, build_federated_data, split_federated
from fedkit.data.partition import PARTITIONERS, Partition, partition, register_partitioner
from fedkit.data.summary import partition_table, render_partition, save_partition

__all__ = [
    "DATASETS",
    "PARTITIONERS",
    "FederatedData",
    "ImageSet",
    "Partition",
    "balanced_subset",
    "build_federated_data",
    "load_split",
    "load_splits",
    "partition",
    "partition_table",
    "register_partitioner",
    "render_partition",
    "save_partition",
    "split_federated",
]
