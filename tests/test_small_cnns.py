"""fedkit's benchmark CNNs: registered in timm, built by ``backbone.name``, the published
layer sizes, and grayscale images read from the first of their three channels."""

from __future__ import annotations

import timm
import torch

from fedkit.config.schema import BackboneConfig
from fedkit.models.backbones import build_classifier, create_backbone, feature_dim


def test_niid_bench_cnn_has_the_papers_layers_and_parameter_count():
    model = build_classifier(BackboneConfig(name="niid_bench_cnn"), 10)
    encoder = model["encoder"]
    convs = [m for m in encoder.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [
        (1, 6, (5, 5)),
        (6, 16, (5, 5)),
    ]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(256, 120), (120, 84), (84, 10)]
    assert sum(p.numel() for p in model.parameters()) == 44_426
    assert feature_dim(encoder) == 84


def test_niid_bench_cnn_reads_the_first_of_three_identical_channels():
    encoder = create_backbone(BackboneConfig(name="niid_bench_cnn")).eval()
    gray = torch.rand(4, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(encoder(gray.expand(-1, 3, -1, -1)), encoder(gray))
    assert "niid_bench_cnn" in timm.list_models()


def test_niid_bench_cnn_fits_other_image_sizes():
    cfg = BackboneConfig(name="niid_bench_cnn", kwargs={"image_size": 32, "in_chans": 3})
    encoder = create_backbone(cfg)
    assert encoder(torch.rand(2, 3, 32, 32)).shape == (2, 84)


def test_niid_bench_cnn_takes_batch_norm_after_each_convolution():
    plain = create_backbone(BackboneConfig(name="niid_bench_cnn"))
    normed = create_backbone(BackboneConfig(name="niid_bench_cnn", kwargs={"batch_norm": True}))
    norms = [m for m in normed.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert [n.num_features for n in norms] == [6, 16]
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules())
