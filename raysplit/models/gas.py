"""GAS (``eejiarong/GAS``) models: the CIFAR "AlexNet" and VGG16-BN with the paper's cuts L1..L4 (seed-code §1.1)."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from .core import SplitModel, flat_dim as _flat_dim, register_model


@register_model(
    "alexnet_gas", input_shape=(3, 32, 32), default_cut="L2",
    description="GAS's CIFAR 'AlexNet' (utils/network.py) as coded: conv1..conv5 | fc1..fc3; cuts L1..L4 = "
                "after conv1 / conv2 / conv3 / conv5; default L2.",
)
def alexnet_gas(num_classes: int, input_shape: Sequence[int]) -> SplitModel:
    """GAS's CIFAR "AlexNet", reproduced AS CODED (``utils/network.py``, ``utils/AlexNet_Split/L1..L4.py``).

    Blocks (index: name -> output for 3x32x32):

    * 0 conv1: Conv(C->32, 3, p1)-MaxPool2-ReLU        -> 32x16x16   (cut L1 = 1)
    * 1 conv2: Conv(32->64, 3, p1)-MaxPool2-ReLU       -> 64x8x8     (cut L2 = 2, GAS's default)
    * 2 conv3: Conv(64->128, 3, p1)                    -> 128x8x8    (cut L3 = 3)
    * 3 conv4: Conv(128->256, 3, p1)                   -> 256x8x8
    * 4 conv5: Conv(256->256, 3, p1)-MaxPool(3, 2)-ReLU -> 256x3x3   (cut L4 = 5: the server is FC only)
    * 5 fc1:   Flatten-Linear(2304 -> 1024)
    * 6 fc2:   Linear(1024 -> 512)
    * 7 fc3:   Linear(512 -> num_classes)

    NOTE: as in the GAS code there is NO non-linearity between conv3, conv4 and conv5, and none between the
    three Linear layers (so conv3-conv5 and fc1-fc3 each compose to a single linear map). This is deliberate
    reproduction of the code, not an oversight here.
    """
    c = input_shape[0]
    convs = [
        nn.Sequential(nn.Conv2d(c, 32, 3, padding=1), nn.MaxPool2d(2), nn.ReLU()),
        nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.MaxPool2d(2), nn.ReLU()),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.Conv2d(128, 256, 3, padding=1),
        nn.Sequential(nn.Conv2d(256, 256, 3, padding=1), nn.MaxPool2d(kernel_size=3, stride=2), nn.ReLU()),
    ]
    flat = _flat_dim(convs, input_shape)
    fcs = [nn.Sequential(nn.Flatten(), nn.Linear(flat, 1024)), nn.Linear(1024, 512), nn.Linear(512, num_classes)]
    return SplitModel(
        [(f"conv{i + 1}", m) for i, m in enumerate(convs)] + [(f"fc{i + 1}", m) for i, m in enumerate(fcs)],
        aliases={"L1": "conv1", "L2": "conv2", "L3": "conv3", "L4": "conv5"},
    )


@register_model(
    "vgg16_bn_gas", input_shape=(3, 32, 32), default_cut="L2",
    description="GAS's VGG16-BN (utils/VGG16_split): conv1..conv13 | fc1..fc3; cuts L1..L4 = after conv "
                "4 / 7 / 10 / 13; default L2.",
)
def vgg16_bn_gas(num_classes: int, input_shape: Sequence[int], dropout: float = 0.5) -> SplitModel:
    """VGG16-BN re-blocked at conv granularity, with GAS's CIFAR classifier.

    The feature extractor is torchvision's VGG16-BN ``features`` (built with torchvision's own
    ``vgg.make_layers(vgg.cfgs["D"], batch_norm=True)``, i.e. exactly ``vgg16_bn(weights=None).features``, without
    allocating torchvision's 25088x4096 classifier we would throw away; initialised like torchvision's VGG).
    Each conv-BN-ReLU is one block, and a MaxPool goes into the block of the conv before it, so:

    * conv1..conv13 (indices 0..12); pools end conv2, conv4, conv7, conv10, conv13
    * cuts L1 = 4 (after conv4, 128x8x8), L2 = 7 (256x4x4), L3 = 10 (512x2x2), L4 = 13 (512x1x1)
    * fc1: Flatten-Linear(512 -> 4096)-ReLU-Dropout   (512*(H/32)*(W/32) inputs in general)
    * fc2: Linear(4096 -> 4096)-ReLU-Dropout
    * fc3: Linear(4096 -> num_classes)

    (GAS's classifier takes the 512-dim flattened features directly: no 7x7 adaptive average pool.)
    """
    from torchvision.models import vgg as tv_vgg  # here, not at import: torchvision costs ~2.7 s a process

    c = input_shape[0]
    cfg = list(tv_vgg.cfgs["D"])
    features = tv_vgg.make_layers(cfg, batch_norm=True)
    if c != 3:
        features[0] = nn.Conv2d(c, 64, kernel_size=3, padding=1)
    # Re-block: conv, bn, relu [, maxpool]
    layers = list(features)
    convs: list[nn.Sequential] = []
    i = 0
    while i < len(layers):
        assert isinstance(layers[i], nn.Conv2d)
        group = layers[i:i + 3]
        i += 3
        if i < len(layers) and isinstance(layers[i], nn.MaxPool2d):
            group.append(layers[i])
            i += 1
        convs.append(nn.Sequential(*group))
    assert len(convs) == 13
    flat = _flat_dim(convs, input_shape)
    fcs = [
        nn.Sequential(nn.Flatten(), nn.Linear(flat, 4096), nn.ReLU(), nn.Dropout(dropout)),
        nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(dropout)),
        nn.Linear(4096, num_classes),
    ]
    model = SplitModel(
        [(f"conv{i + 1}", m) for i, m in enumerate(convs)] + [(f"fc{i + 1}", m) for i, m in enumerate(fcs)],
        aliases={"L1": "conv4", "L2": "conv7", "L3": "conv10", "L4": "conv13"},
    )
    # torchvision's VGG initialisation
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.constant_(m.bias, 0)
    return model
