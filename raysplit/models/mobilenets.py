"""MobileNets: MobileNetV1 for Hydra (seed-code §2.2) and torchvision's MobileNetV3-Large."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from .core import SplitModel, register_model

# (output channels, stride) of the 13 depthwise-separable blocks, CIFAR variant (kuangliu/pytorch-cifar layout;
# the ImageNet MobileNetV1 uses the same list, only its stem has stride 2).
_V1_CFG = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
           (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1)]


@register_model(
    "mobilenet_v1", input_shape=(3, 32, 32), default_cut=4,
    description="MobileNetV1 (CIFAR variant) at conv granularity for Hydra: stem | dw1 | pw1 | ... | dw13 | pw13 "
                "| pool | fc (29 blocks, 27 convs); default cut 4 (Hydra's scripts use cut_a=4, cut_b=23).",
)
def mobilenet_v1(num_classes: int, input_shape: Sequence[int], stem_stride: int = 1,
                 width_mult: float = 1.0) -> SplitModel:
    """MobileNetV1 split at depthwise/pointwise-conv granularity (27 conv blocks), for Hydra.

    Hydra's repository (``jtirana98/Hydra_tackling-CF-in-SFL``) never committed ``models/mobilenet.py``, so its
    layer indexing is UNKNOWN (seed-code §2.2); the indexing below is OUR reading. Its scripts use
    ``cut_a = 4, cut_b = 23`` (``MobileNetV1(in, out, start, end)`` with -1 meaning "from the start" / "to the
    end"). With this indexing ``split3(4, 23)`` puts stem, dw1, pw1, dw2 on the client and the last two
    depthwise-separable blocks (dw12..pw13) plus pool and fc in the head, which matches the inference in the
    notes; it is not verified against Hydra's code.

    Block indices (cut k = blocks[:k] on the client):

    * 0  ``stem``: Conv3x3(C->32, stride ``stem_stride``)-BN-ReLU   (CIFAR: stride 1; ImageNet: 2)
    * 2i-1 ``dw{i}`` (i = 1..13): depthwise Conv3x3(stride s_i, groups=c)-BN-ReLU
    * 2i   ``pw{i}`` (i = 1..13): pointwise Conv1x1-BN-ReLU
    * 27 ``pool``: AdaptiveAvgPool2d(1)-Flatten
    * 28 ``fc``: Linear(1024 -> num_classes)

    Channels/strides (CIFAR variant): 64/1, 128/2, 128, 256/2, 256, 512/2, 512 x5, 1024/2, 1024.
    Built from torchvision's ``Conv2dNormActivation``; conv weights use torchvision's MobileNet init.
    """
    from torchvision.ops.misc import Conv2dNormActivation  # here, not at import: torchvision costs ~2.7 s a process

    c = input_shape[0]

    def ch(n: int) -> int:
        return max(8, int(n * width_mult))

    cin = ch(32)
    blocks: list[tuple[str, nn.Module]] = [("stem", Conv2dNormActivation(c, cin, 3, stride=stem_stride))]
    for i, (cout, stride) in enumerate(_V1_CFG, start=1):
        cout = ch(cout)
        blocks.append((f"dw{i}", Conv2dNormActivation(cin, cin, 3, stride=stride, groups=cin)))
        blocks.append((f"pw{i}", Conv2dNormActivation(cin, cout, 1)))
        cin = cout
    blocks.append(("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1))))
    blocks.append(("fc", nn.Linear(cin, num_classes)))
    model = SplitModel(blocks)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model


@register_model(
    "mobilenet_v3_large", input_shape=(3, 32, 32), default_cut="features.3",
    description="torchvision MobileNetV3-Large: features.0 .. features.16 | pool | classifier (19 blocks).",
)
def mobilenet_v3_large(num_classes: int, input_shape: Sequence[int], dropout: float = 0.2) -> SplitModel:
    """torchvision ``mobilenet_v3_large(weights=None, num_classes=...)`` re-blocked:

    * 0..16 ``features.0`` .. ``features.16``: each entry of ``.features`` (stem, 15 inverted residuals, last conv)
    * 17 ``pool``: AdaptiveAvgPool2d(1)-Flatten
    * 18 ``classifier``: Linear(960->1280)-Hardswish-Dropout-Linear(1280->num_classes)

    The torchvision (ImageNet) strides are kept (total stride 32: 32x32 inputs reach 1x1). The default cut
    ``features.3`` (our choice, no paper fixes one) leaves the stem and first three inverted residuals
    (24x8x8 for 32x32 inputs) on the client.
    """
    from torchvision.models import mobilenet_v3_large as tv_mobilenet_v3_large  # here: ~2.7 s a process

    net = tv_mobilenet_v3_large(weights=None, num_classes=num_classes, dropout=dropout)
    c = input_shape[0]
    if c != 3:
        old = net.features[0][0]
        net.features[0][0] = nn.Conv2d(c, old.out_channels, old.kernel_size, old.stride, old.padding, bias=False)
        nn.init.kaiming_normal_(net.features[0][0].weight, mode="fan_out")
    blocks: list[tuple[str, nn.Module]] = [(f"features.{i}", m) for i, m in enumerate(net.features)]
    blocks.append(("pool", nn.Sequential(net.avgpool, nn.Flatten(1))))
    blocks.append(("classifier", net.classifier))
    return SplitModel(blocks)
