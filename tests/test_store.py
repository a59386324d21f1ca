"""Client state stores: a client keeps only what must persist, the disk store keeps a
bounded number of memories in memory, and checkpoints write only what changed."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import prepared, ssl_recipe, tiny_recipe

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.engine import run_round
from fedkit.rundir import logs
from fedkit.rundir.integrity import sha256_file
from fedkit.rundir.store import (
    ClientMemory,
    DiskStore,
    MemoryStore,
    read_memory,
    write_memory,
)


def memory(value: float) -> ClientMemory:
    return ClientMemory(
        model={"a": torch.full((3,), value)},
        tensors={"c.x": torch.ones(2) * value},
        state={"d": value},
        participations=2,
        cluster=1,
    )


def test_a_memory_file_reads_back_equal(tmp_path):
    write_memory(tmp_path / "m.safetensors", memory(2.5))
    back = read_memory(tmp_path / "m.safetensors")
    assert torch.equal(back.model["a"], torch.full((3,), 2.5))
    assert torch.equal(back.tensors["c.x"], torch.full((2,), 2.5))
    assert (back.state, back.participations, back.cluster) == ({"d": 2.5}, 2, 1)
    write_memory(tmp_path / "n.safetensors", ClientMemory())
    assert read_memory(tmp_path / "n.safetensors").model is None


def test_disk_store_keeps_a_bounded_cache_and_reads_the_rest_back(tmp_path):
    store = DiskStore(tmp_path, cache=3)
    for cid in range(10):
        store.put(cid, memory(float(cid)), version=1)
    assert len(store._cache) == 3 and store.ids() == list(range(10))
    assert len(list(tmp_path.glob("*.safetensors"))) == 10
    assert store.get(0).state == {"d": 0.0}  # read from disk, now cached
    assert len(store._cache) == 3
    manifest = store.persist(tmp_path)
    assert {c: e["file"] for c, e in manifest.items()} == {
        c: f"{c}.r000001.safetensors" for c in range(10)
    }
    assert all(e["sha256"] == sha256_file(tmp_path / e["file"]) for e in manifest.values())
    assert store.changed() == {}


def test_memory_store_persists_only_changed_clients(tmp_path):
    store = MemoryStore()
    for cid in range(4):
        store.put(cid, memory(float(cid)), version=1)
    first = store.persist(tmp_path)
    store.put(2, memory(9.0), version=2)
    second = store.persist(tmp_path)
    assert {c: e["file"] for c, e in second.items()} == {
        **{c: e["file"] for c, e in first.items()},
        2: "2.r000002.safetensors",
    }
    written = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert written == sorted({*(e["file"] for e in first.values()), "2.r000002.safetensors"})
    again = MemoryStore()
    again.adopt(tmp_path, second)
    assert again.get(2).state == {"d": 9.0}


def test_auto_store_goes_to_disk_above_the_memory_budget(tmp_path):
    from fedkit.core.engine import store_spec
    from fedkit.plugin.registry import registries

    recipe, regs = validate({"engine": {"memory_budget_mb": 1}}), registries()
    assert isinstance(store_spec(recipe, regs, tmp_path, 2**19).make(), MemoryStore)
    assert isinstance(store_spec(recipe, regs, tmp_path, 2**21).make(), DiskStore)
    store = store_spec(validate({"engine": {"store": "disk"}}), regs, None, 0).make()
    folder = store.folder
    assert folder.is_dir()
    store.close()
    assert not folder.exists()  # a temporary store without a run directory cleans up


@pytest.mark.slow
def test_clients_keep_only_private_and_declared_keys():
    fedavg = prepared(tiny_recipe(federation={"rounds": 1}))
    run_round(fedavg, 1)
    assert all(m.model == {} for _, m in fedavg.executor.store.items())
    byol = prepared(ssl_recipe("fedbyol", ("dapu", {"mu": 0.1}), rounds=1))
    run_round(byol, 1)
    kept = set(byol.executor.store.get(0).model)
    template = byol.server.template.state_dict()
    expected = {k for k in template if k.startswith(("target_", "predictor."))}
    assert kept == expected and len(kept) < len(template)


class ReadsLocal:
    """An outside plugin that implements update_client without declaring kept keys."""

    from fedkit import hookimpl

    @hookimpl
    def update_client(self, ctx, received, local):
        return None


def test_a_plugin_that_does_not_declare_kept_keys_keeps_everything():
    run = prepared(
        tiny_recipe(plugins=["fedavg", "reads"], federation={"rounds": 1}), reads=ReadsLocal()
    )
    run_round(run, 1)
    assert set(run.executor.store.get(0).model) == set(run.server.template.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("store", ["memory", "disk"])
def test_checkpoints_write_only_clients_that_trained(tmp_path, store):
    def checkpoint_bytes(num_clients: int) -> int:
        raw = ssl_recipe("fedbyol", rounds=2)
        raw["data"].update(num_clients=num_clients, max_train=40 * num_clients)
        raw["federation"]["clients_per_round"] = 2
        raw["engine"] = {"store": store}
        out = tmp_path / f"{store}-{num_clients}"
        run = runs.start(validate(raw), out)
        runs.execute(run, out)
        folder = (
            out
            / "checkpoints"
            / json.loads((out / "checkpoints/latest.json").read_text())["folder"]
        )
        manifest = json.loads((folder / "state.json").read_text())["clients"]
        trained_last = {str(c) for c in logs.read_metrics(out)[-1]["clients"]}
        files = {entry["file"] for cid, entry in manifest.items() if cid in trained_last}
        assert all(name.endswith(".r000002.safetensors") for name in files)
        on_disk = {p.name for p in (out / "clients").glob("*.safetensors")}
        assert {e["file"] for e in manifest.values()} <= on_disk  # and the previous
        assert len(on_disk) <= 2 * len(manifest)  # checkpoint's (2 kept), nothing more
        return sum((out / "clients" / n).stat().st_size for n in files) + sum(
            p.stat().st_size for p in folder.iterdir()
        )

    small, large = checkpoint_bytes(4), checkpoint_bytes(24)
    assert large <= 1.2 * small
