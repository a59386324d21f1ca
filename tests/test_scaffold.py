"""SCAFFOLD: on a quadratic problem where FedAvg drifts, SCAFFOLD reaches the optimum and
FedAvg settles at its own (computable) fixed point; control variates are auxiliary in
the ledger, follow option II, and survive kill -9 and --resume bit for bit.

The problem: two equally large clients with f_k(w) = ½(w − b_k)ᵀA_k(w − b_k) on w ∈ R²,
A_0 = diag(1, 0.1), A_1 = diag(0.1, 1), b_0 = (1, 0), b_1 = (0, 1), K = 20 full-batch
gradient steps at η = 0.1 per round. The global optimum is w* = (A_0 + A_1)⁻¹(A_0b_0 +
A_1b_1) = (10/11, 10/11). With M_k = (I − ηA_k)^K a client maps w to b_k + M_k(w − b_k),
so FedAvg converges to the w solving (I − M̄)w = mean_k (I − M_k)b_k ≈ (0.828, 0.828).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import kill_after_checkpoint, prepared, spied, tiny_recipe
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

from fedkit import hookimpl
from fedkit.cli.app import app
from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.engine import run_round
from fedkit.rundir.logs import read_clients, read_ledger, read_metrics
from fedkit.rundir.store import read_memory
from fedkit.training.loop import Objective
from fedkit_plugins.scaffold import DELTA, GLOBAL, OWN

A = {0: torch.diag(torch.tensor([1.0, 0.1])), 1: torch.diag(torch.tensor([0.1, 1.0]))}
B = {0: torch.tensor([1.0, 0.0]), 1: torch.tensor([0.0, 1.0])}
STEPS, LR, ROUNDS, TARGET = 20, 0.1, 30, 0.01


class Vector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))


class Quadratic:
    """Model w ∈ R²; client k takes STEPS gradient steps on its quadratic per round."""

    @hookimpl
    def init_models(self, server):
        return [nn.ModuleDict({"w": Vector()})]

    @hookimpl
    def local_objective(self, ctx, model):
        a, b = A[ctx.id], B[ctx.id]

        def loss(model, batch):
            e = model["w"].weight - b
            return 0.5 * e @ a @ e

        return Objective(loss, lambda: [(torch.zeros(1),)] * STEPS)


def quadratic_recipe(*plugins, rounds: int = ROUNDS, momentum: float = 0.0):
    return tiny_recipe(
        plugins=["quad", *plugins],
        data={"partition": {"name": "iid"}, "num_clients": 2, "max_train": 200},
        federation={
            "rounds": rounds,
            "clients_per_round": 2,
            "optimizer": {"name": "sgd", "lr": LR, "momentum": momentum},
        },
        evaluation={"protocol": "none", "every": 0},
    )


def optimum_and_fedavg_fixed_point() -> tuple[torch.Tensor, torch.Tensor]:
    eye = torch.eye(2)
    w_star = torch.linalg.solve(A[0] + A[1], A[0] @ B[0] + A[1] @ B[1])
    m = {k: torch.matrix_power(eye - LR * A[k], STEPS) for k in A}
    lhs = eye - (m[0] + m[1]) / 2
    rhs = ((eye - m[0]) @ B[0] + (eye - m[1]) @ B[1]) / 2
    return w_star, torch.linalg.solve(lhs, rhs)


def trajectory(*plugins: str) -> list[torch.Tensor]:
    run = prepared(quadratic_recipe(*plugins), quad=Quadratic)
    out = []
    for r in range(1, ROUNDS + 1):
        run_round(run, r)
        out.append(run.server.pool[0]["w.weight"].clone())
    return out


def rounds_to(target: torch.Tensor, path: list[torch.Tensor], tol: float) -> int | None:
    return next((r for r, w in enumerate(path, 1) if (w - target).norm() < tol), None)


@pytest.mark.slow
def test_scaffold_reaches_the_optimum_where_fedavg_drifts():
    w_star, w_fedavg = optimum_and_fedavg_fixed_point()
    assert torch.allclose(w_star, torch.full((2,), 10 / 11))
    assert (w_fedavg - w_star).norm() > 0.1  # the drift the setup is built to show
    fedavg, scaffold = trajectory(), trajectory("scaffold")
    assert (fedavg[-1] - w_fedavg).norm() < 1e-4  # FedAvg settles at its fixed point...
    assert rounds_to(w_star, fedavg, TARGET) is None  # ...and never gets near w*
    reached = rounds_to(w_star, scaffold, TARGET)
    assert reached is not None and reached <= 10
    assert (scaffold[-1] - w_star).norm() < 1e-4


def test_option_two_control_variates_and_ledger_categories():
    run, spy = spied(quadratic_recipe("scaffold", rounds=2), quad=Quadratic)
    run_round(run, 1)
    x0 = torch.zeros(2)
    for up in spy.uploads[1]:
        y = up.tensors["w.weight"]
        # c = c_i = 0 in round 1: c_i⁺ = (x − y)/(K·η) and Δc_i = c_i⁺
        assert torch.allclose(up.tensors[DELTA + "w.weight"], (x0 - y) / (STEPS * LR))
        memory = run.executor.store.get(up.client)
        assert torch.equal(memory.tensors[OWN + "w.weight"], up.tensors[DELTA + "w.weight"])
    deltas = torch.stack([u.tensors[DELTA + "w.weight"] for u in spy.uploads[1]])
    c = run.server.pool[0][GLOBAL + "w.weight"]
    assert torch.allclose(c, deltas.mean(0))  # |S| = N: c = mean of Δc_i
    assert not any(k.startswith(DELTA) for k in run.server.pool[0])
    row = run_round(run, 2)
    vec_bytes = 2 * 4
    assert row["bytes"]["down_aux"] == 2 * vec_bytes and row["bytes"]["up_aux"] == 2 * vec_bytes
    assert row["bytes"]["down_data"] == row["bytes"]["up_data"] == 0
    assert row["bytes"]["up_model"] == 2 * vec_bytes


def test_each_step_moves_by_the_gradient_and_c_minus_ci_outside_momentum():
    """The first step of round 2 from the global w: y = w − η·(g + c − c_i) with plain
    SGD; with momentum the correction is not in the momentum buffer."""
    for momentum in (0.0, 0.9):
        first, buffers = {}, {}

        class FirstStep:
            @hookimpl(trylast=True)  # after scaffold's correction, before the step
            def before_step(
                self, ctx, model, optimizer, first=first, buffers=buffers, rho=momentum
            ):
                if ctx.id not in first:
                    first[ctx.id] = model["w"].weight.detach().clone()
                elif ctx.id not in buffers and rho:  # the step after: its buffer
                    state = optimizer.state[model["w"].weight]
                    buffers[ctx.id] = state["momentum_buffer"].clone()

        run = prepared(quadratic_recipe("scaffold", rounds=2, momentum=momentum), quad=Quadratic)
        run_round(run, 1)
        run.executor.worker.plugins.pm.register(FirstStep(), name="first-step")
        w, c = run.server.pool[0]["w.weight"], run.server.pool[0][GLOBAL + "w.weight"]
        own = {cid: run.executor.store.get(cid).tensors[OWN + "w.weight"].clone() for cid in (0, 1)}
        run_round(run, 2)
        lr = run.recipe.federation.optimizer.lr
        for cid in (0, 1):
            assert torch.allclose(first[cid], w - lr * (c - own[cid]), atol=1e-6)
            if momentum:  # the buffer after one step holds the gradient alone
                plain = A[cid] @ (w - B[cid])
                assert torch.allclose(buffers[cid], plain, atol=1e-5)
        assert not torch.allclose(c, torch.zeros_like(c))


def checkpoint_file(out, name: str) -> dict[str, torch.Tensor]:
    pointer = json.loads((out / "checkpoints" / "latest.json").read_text())
    return load_file(out / "checkpoints" / pointer["folder"] / f"{name}.safetensors")


def client_memories(out) -> dict[str, dict[str, torch.Tensor]]:
    """What each client keeps, as of the newest checkpoint (one file per client, named in
    its state.json), flattened to ``<client>/<model|tensors>/<key>``."""
    pointer = json.loads((out / "checkpoints" / "latest.json").read_text())
    state = json.loads((out / "checkpoints" / pointer["folder"] / "state.json").read_text())
    flat = {}
    for cid, entry in state["clients"].items():
        memory = read_memory(out / "clients" / entry["file"])
        flat.update({f"{cid}/model/{k}": v for k, v in (memory.model or {}).items()})
        flat.update({f"{cid}/tensors/{k}": v for k, v in memory.tensors.items()})
    return flat


@pytest.mark.slow
def test_control_variates_survive_sigkill_and_resume(write_recipe, tmp_path):
    raw = tiny_recipe(
        plugins=["fedavg", "scaffold"],
        data={"num_clients": 4, "max_train": 200},
        federation={
            "rounds": 4,
            "clients_per_round": 2,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0},
        },
    )
    path = write_recipe(raw)
    full, killed = tmp_path / "full", tmp_path / "killed"
    runs.execute(runs.start(validate(raw), full), full)  # in-process: same numbers
    stopped_at = kill_after_checkpoint(path, killed, 2)
    assert 2 <= stopped_at < 4
    assert max(r["round"] for r in read_metrics(killed)) >= stopped_at
    resumed = CliRunner().invoke(app, ["run", "--resume", str(killed)])  # in-process: faster
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming {killed} after round {stopped_at}" in resumed.output.replace("\n", "")
    assert read_metrics(killed) == read_metrics(full)
    ledger = read_ledger(full)
    assert read_ledger(killed) == ledger
    assert len([r for r in ledger if r["down_model"]]) == 4 * 2  # no job booked twice
    assert read_clients(killed) == read_clients(full)  # per-client values, once in metrics
    assert [r["round"] for r in read_clients(full)] == [1, 2, 3, 4]
    pools = checkpoint_file(full, "pool"), checkpoint_file(killed, "pool")
    for a, b in (pools, (client_memories(full), client_memories(killed))):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert any("scaffold.c." in k or "/tensors/c." in k for k in a)
