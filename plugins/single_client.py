"""Single-client baseline: every client trains alone, with the same local recipe.

List it next to the method whose local training it should use (``[fedbyol,
single_client]``): it declares every key of the model private, so nothing is sent down,
nothing is uploaded and the ledger stays at zero, while each client runs R·E epochs of
that method on its own data, exactly the compute of the federated run.

The score is the mean over clients (FedU paper's comparison): with a representation
protocol the recipe must set ``evaluation.personal: true``, which scores each trained
client's own encoder on the pooled client train images and the global test set
(``personal_<metric>``, and ``client_<metric>`` per client). Cluster 0's model never
changes, so its score (``<metric>``) only measures the initialisation.
"""

from __future__ import annotations

from torch import nn

from fedkit import RecipeError, Server, hookimpl


class SingleClient:
    """Single-client baseline: no communication; score = mean over clients' own encoders."""

    @hookimpl
    def configure(self, server: Server) -> None:
        recipe = server.recipe
        ev = recipe.evaluation
        if ev.protocol in ("knn", "linear", "semi") and not ev.personal:
            raise RecipeError(
                "evaluation.personal",
                "true with single_client (each client's own encoder is the result; the "
                "server's model never changes)",
                ev.personal,
            )

    @hookimpl
    def private_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        return list(model.state_dict())
