"""A real site's own images (``fedkit deploy node --data DIR``): one client's data from a
local ImageFolder, labelled by the federation's class names and standardised with the
federation's statistics; a node set up with it trains on those images."""

from __future__ import annotations

import json

import pytest
from conftest import setup_message, tiny_recipe, write_images

from fedkit.config.schema import validate
from fedkit.core.engine import jobs, prepare
from fedkit.data.site import load_site
from fedkit.errors import RecipeError

CLASSES = [str(d) for d in range(10)]
STATS = ((0.1, 0.2, 0.3), (0.5, 0.5, 0.5))


def cfg(local_test_size: int = 2):
    raw = tiny_recipe(data={"local_test_size": local_test_size})
    return validate(raw).data


def test_a_flat_folder_holds_out_its_local_test_set_by_class(tmp_path):
    write_images(tmp_path / "site", {"3": 6, "7": 4})
    data = load_site(tmp_path / "site", cfg(2), 5, CLASSES, *STATS, seed=0)
    assert data.id == 5 and len(data.train) == 8 and len(data.test) == 2
    assert sorted(data.test.labels.tolist()) == [3, 7]  # one of each class, by its share
    assert set(data.train.labels.tolist()) == {3, 7}  # the folder names, not their order
    assert data.train.classes == CLASSES and (data.train.mean, data.train.std) == STATS
    assert tuple(data.train.images.shape[1:]) == (3, 16, 16)  # the recipe's image_size


def test_train_and_test_folders_are_taken_as_they_are(tmp_path):
    write_images(tmp_path / "site" / "train", {"0": 3, "9": 2})
    write_images(tmp_path / "site" / "test", {"9": 4}, seed=1)
    data = load_site(tmp_path / "site", cfg(), 0, CLASSES, *STATS, seed=0)
    assert sorted(data.train.labels.tolist()) == [0, 0, 0, 9, 9]
    assert data.test.labels.tolist() == [9, 9, 9, 9]


def test_a_class_the_federation_does_not_have_is_refused_by_name(tmp_path):
    write_images(tmp_path / "site", {"3": 2, "cat": 2})
    with pytest.raises(RecipeError) as info:
        load_site(tmp_path / "site", cfg(), 0, CLASSES, *STATS, seed=0)
    assert "--data" in str(info.value) and "cat" in str(info.value)
    with pytest.raises(RecipeError, match="--data"):
        load_site(tmp_path / "nowhere", cfg(), 0, CLASSES, *STATS, seed=0)


def test_a_node_with_a_site_trains_on_the_sites_images(tmp_path):
    """The setup message the ``flower`` executor sends, answered by a node host with a
    site: it declares the site's sample count and its train reply weighs that many."""
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from flwr.app import RecordDict

    from fedkit.flower.node import NodeHost
    from fedkit.flower.records import get_meta, job_content, result_of

    write_images(tmp_path / "site", {"3": 9, "7": 5})
    raw = tiny_recipe(federation={"rounds": 1, "clients_per_round": 3}, data={"local_test_size": 4})
    run = prepare(validate(raw))
    content = setup_message(run, "t")
    host, state = NodeHost(tmp_path / "memories", site=tmp_path / "site"), RecordDict()
    answer = get_meta(host.handle("query", content, state, 2))
    assert answer == {"client": 2, "samples": 14 - run.recipe.data.local_test_size}
    run.record.round = 1
    (job,) = [j for j in jobs(run, [2])]
    reply = host.handle("train", job_content(job, [0], None), state, 2)
    result, need = result_of(reply)
    assert need is None and result.failure is None
    assert result.weight == answer["samples"] and set(result.upload) == set(run.server.pool[0])
    assert json.loads(json.dumps(result.metrics))  # a real round: its loss came back
    run.close()


def test_deploy_node_refuses_a_data_path_that_is_not_a_folder(tmp_path):
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from typer.testing import CliRunner

    from fedkit.cli.app import app

    args = ["deploy", "node", "--superlink", "127.0.0.1:1", "--partition", "0"]
    args += ["--dir", str(tmp_path / "node"), "--insecure", "--data", str(tmp_path / "none")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--data" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "node").exists()
