"""Local training: the objective and the one loop that fits it, batches, the recipe's
optimiser and learning-rate schedule, the supervised objective, precision and layout."""

from fedkit.training.batching import batches, labelled_batches, normalize, transfer
from fedkit.training.loop import LoopResult, NonFiniteLoss, Objective, run_loop, split_loss
from fedkit.training.optim import make_optimizer, round_lr
from fedkit.training.supervised import (
    accuracy,
    cross_entropy_loss,
    has_batchnorm,
    supervised_loss,
    supervised_objective,
)

__all__ = [
    "LoopResult",
    "NonFiniteLoss",
    "Objective",
    "accuracy",
    "batches",
    "cross_entropy_loss",
    "has_batchnorm",
    "labelled_batches",
    "make_optimizer",
    "normalize",
    "round_lr",
    "run_loop",
    "split_loss",
    "supervised_loss",
    "supervised_objective",
    "transfer",
]
