"""Differential-privacy accounting shared by ``dp`` (client level) and ``dpsgd`` (sample
level): ε of the subsampled Gaussian mechanism from opacus's accountants, and the noise
multiplier σ that keeps a number of steps within a budget, from opacus's own calibration
(``get_noise_multiplier``). One place calls opacus, so both plugins count alike; each
names its RDP orders and calibration tolerance (``dp``: ``RDP_ORDERS``, decision 0021;
``dpsgd``: opacus's default grid, as its own optimiser reports ε). Needs the ``dp``
extra (opacus), imported only when a function runs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

RDP_ORDERS = tuple(range(2, 257))
"""Integer RDP orders α, where the RDP of the subsampled Gaussian is a finite sum that
opacus and Google's dp-accounting compute alike (at fractional orders they evaluate an
infinite series differently and part by up to 0.1 in ε; decision 0021); up to 256, so
small budgets find their order."""

OPACUS_ORDERS = None
"""``orders`` for opacus's default grid (1.1, 1.2, …, 10.9, 12, …, 63)."""

OPACUS_TOLERANCE = 0.01
"""opacus's default calibration tolerance: ε within 0.01 below the target."""

Step = Sequence[float]
"""A row of an accounting history: (σ, q, steps)."""


@contextmanager
def quiet() -> Iterator[None]:
    """Silence the accountants' warnings at the edges of their range ("optimal order is
    the smallest/largest alpha", PRV's overflows when there is barely any noise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def order_arguments(accountant: str, orders: Sequence[float] | None) -> dict[str, object]:
    """The ``alphas`` keyword for opacus's RDP accountant: none for the other accountants,
    or to keep opacus's default grid."""
    return {"alphas": orders} if accountant == "rdp" and orders is not None else {}


def epsilon(
    history: Iterable[Step],
    delta: float,
    *,
    accountant: str = "rdp",
    orders: Sequence[float] | None,
) -> float:
    """ε at ``delta`` after the (σ, q, steps) rows of ``history``, composed by opacus's
    ``accountant`` (``rdp`` or ``prv``): 0 with no step taken, ∞ once a step had no noise."""
    rows = [(sigma, q, int(steps)) for sigma, q, steps in history if steps > 0]
    if not rows:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in rows):
        return math.inf
    from opacus.accountants import create_accountant

    counter = create_accountant(mechanism=accountant)
    counter.history = rows
    with quiet():
        return float(counter.get_epsilon(delta=delta, **order_arguments(accountant, orders)))


def calibrated_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    *,
    accountant: str = "rdp",
    orders: Sequence[float] | None,
    tolerance: float,
) -> float:
    """The σ with which ``steps`` steps at ``sample_rate`` spend at most ``target_epsilon``
    at ``delta``: opacus's ``get_noise_multiplier`` (a bisection on its accountant),
    stopping within ``tolerance`` below the target. A budget no σ up to 1e6 meets is
    opacus's ``ValueError``."""
    from opacus.accountants.utils import get_noise_multiplier

    with quiet():
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant,
                epsilon_tolerance=tolerance,
                **order_arguments(accountant, orders),
            )
        )
