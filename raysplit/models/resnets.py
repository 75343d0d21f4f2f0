"""ResNets: CycleSL's ResNet9 (seed-code §4.2) and torchvision ResNet-18/101 with a CIFAR stem."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from .core import Residual, SplitModel, flat_dim, register_model


def _conv_block(cin: int, cout: int, pool: bool = False) -> nn.Sequential:
    """CycleSL's ``conv_block``: Conv3x3(p1)-BN-ReLU [-MaxPool2]."""
    layers = [nn.Conv2d(cin, cout, kernel_size=3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


@register_model(
    "resnet9", input_shape=(3, 32, 32), default_cut=3,
    description="CycleSL's ResNet9_cifar: conv1 | conv2 | res1 | conv3 | conv4 | res2 | classifier "
                "(= CycleSL's seq indices 0..6); default cut 3 (= 'res1', client output 128x16x16).",
)
def resnet9(num_classes: int, input_shape: Sequence[int]) -> SplitModel:
    """CycleSL ``ResNet9_cifar`` (from the Kaggle "ResNet9 CIFAR-10 in 5 minutes" model). Blocks = CycleSL's
    ``seq`` indices, so CycleSL's ``cut`` is our cut index (default 3, ablation 1..6):

    * 0 conv1:      conv_block(C, 64)
    * 1 conv2:      conv_block(64, 128, pool)          -> 128x16x16
    * 2 res1:       x + [conv_block(128,128), conv_block(128,128)](x)
    * 3 conv3:      conv_block(128, 256, pool)
    * 4 conv4:      conv_block(256, 512, pool)
    * 5 res2:       x + [conv_block(512,512) x2](x)      -> 512x4x4
    * 6 classifier: MaxPool2d(4)-Flatten-Linear(512 -> num_classes)

    ``conv_block`` = Conv3x3(p1)-BN-ReLU[-MaxPool2]. (The code's ReLUs are inplace; these are not: same values.)
    """
    c = input_shape[0]
    feats = [
        _conv_block(c, 64),
        _conv_block(64, 128, True),
        Residual(_conv_block(128, 128), _conv_block(128, 128)),
        _conv_block(128, 256, True),
        _conv_block(256, 512, True),
        Residual(_conv_block(512, 512), _conv_block(512, 512)),
    ]
    pool = nn.MaxPool2d(4)
    flat = flat_dim(feats + [pool], input_shape)
    classifier = nn.Sequential(pool, nn.Flatten(), nn.Linear(flat, num_classes))
    names = ["conv1", "conv2", "res1", "conv3", "conv4", "res2"]
    return SplitModel(list(zip(names, feats)) + [("classifier", classifier)])


def _torchvision_resnet(arch: str, num_classes: int, input_shape: Sequence[int], cifar_stem: bool) -> SplitModel:
    from torchvision.models import resnet as tv_resnet  # here, not at import: torchvision costs ~2.7 s a process

    net = getattr(tv_resnet, arch)(weights=None, num_classes=num_classes)
    c = input_shape[0]
    if cifar_stem:
        net.conv1 = nn.Conv2d(c, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        stem = nn.Sequential(net.conv1, net.bn1, net.relu)
    else:
        if c != 3:
            net.conv1 = nn.Conv2d(c, 64, kernel_size=7, stride=2, padding=3, bias=False)
            nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
        stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
    blocks: list[tuple[str, nn.Module]] = [("stem", stem)]
    aliases: dict[str, str] = {}
    for li in range(1, 5):
        layer = getattr(net, f"layer{li}")
        for bi, block in enumerate(layer):
            blocks.append((f"layer{li}.{bi}", block))
        aliases[f"layer{li}"] = f"layer{li}.{len(layer) - 1}"
    blocks.append(("head", nn.Sequential(net.avgpool, nn.Flatten(1), net.fc)))
    return SplitModel(blocks, aliases=aliases)


_RESNET_DOC = """torchvision ``{arch}`` (weights=None) re-blocked for splitting.

    Blocks: ``stem`` (CIFAR stem by default: Conv3x3 stride 1 - BN - ReLU, no max-pool; ``cifar_stem=False`` keeps
    torchvision's 7x7/2 conv + max-pool), then every {kind} of layer1..layer4 as its own block, named
    ``layer1.0``, ``layer1.1``, ..., then ``head`` = AdaptiveAvgPool-Flatten-fc.
    Cut names: each block name (a cut after that block) plus aliases ``layer1``..``layer4`` = after the last
    block of that layer. ``stem`` = cut 1, then one index per residual block (seed-code §2.2 describes a similar
    ResNet indexing by Hydra's author, but with GAP and FC as separate indices; ours merges them into ``head``).
    """


@register_model(
    "resnet18", input_shape=(3, 32, 32), default_cut="layer1",
    description="torchvision ResNet-18 with a CIFAR stem: stem | layer1.0 .. layer4.1 | head; aliases layer1..4; "
                "default cut layer1.",
)
def resnet18(num_classes: int, input_shape: Sequence[int], cifar_stem: bool = True) -> SplitModel:
    return _torchvision_resnet("resnet18", num_classes, input_shape, cifar_stem)


@register_model(
    "resnet101", input_shape=(3, 32, 32), default_cut="layer1",
    description="torchvision ResNet-101 with a CIFAR stem: stem | layer1.0 .. layer4.2 | head; aliases "
                "layer1..4; default cut layer1.",
)
def resnet101(num_classes: int, input_shape: Sequence[int], cifar_stem: bool = True) -> SplitModel:
    return _torchvision_resnet("resnet101", num_classes, input_shape, cifar_stem)


resnet18.__doc__ = _RESNET_DOC.format(arch="resnet18", kind="BasicBlock")
resnet101.__doc__ = _RESNET_DOC.format(arch="resnet101", kind="Bottleneck")
