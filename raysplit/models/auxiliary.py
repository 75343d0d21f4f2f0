"""Ampere's lightweight auxiliary network (../shared/papers/ampere.txt §3.2.2), generated from the server block.

The paper: "a compact two-layer design: the first layer replicates the first layer of the server block but halves
the dimension; the second is a fully connected layer with the same loss function as the server block", with the
dimension ratio (default 0.5) adjustable. Our reading, for the layer types of the zoo (the first module of the
server block that holds parameters, in forward order):

- ``Conv2d`` -> the same convolution (kernel, stride, padding, dilation) at ``ratio x`` output channels, then ReLU
  (a grouped/depthwise convolution keeps ``gcd(in, out')`` groups);
- torchvision ``Conv2dNormActivation`` (conv-BN-activation) -> the same at ``ratio x`` output channels;
- torchvision ``InvertedResidual`` (MobileNetV3) -> an inverted residual with ``ratio x`` expanded and output
  channels (same kernel, stride, squeeze-excitation and activation);
- torchvision ``BasicBlock`` / ``Bottleneck`` (ResNets) -> the same block at ``ratio x`` width, with a 1x1
  projection on the skip;
- raysplit ``Residual`` (CycleSL's ResNet9: the skip forces equal widths) -> its first convolution block at
  ``ratio x`` output channels;
- ``Linear`` -> flatten, a linear layer of ``ratio x`` outputs, ReLU;
- ``LastStepLSTM`` -> an LSTM of ``ratio x`` hidden units (last step);
- torchvision ``EncoderBlock`` (ViT) -> a per-token linear map to ``ratio x`` width, then one encoder block of that
  width (heads: the largest count <= the original that divides it, MLP ``ratio x``).

The second layer pools what the first produces into a vector (global average pooling for feature maps, the class
token after a LayerNorm for tokens) and maps it to the classes. Building blocks only: no Ray, no MLflow.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from .core import LastStepLSTM, Residual

SUPPORTED = ("Conv2d", "Conv2dNormActivation", "InvertedResidual", "BasicBlock", "Bottleneck", "Residual", "Linear",
             "LastStepLSTM", "EncoderBlock", "LayerNorm")
_LAYERS = (nn.Conv2d, nn.Linear)


def _tv():
    """torchvision's block classes. Importing torchvision costs a process about 2.7 s (it pulls in torch._dynamo),
    so the model zoo imports it only in the builders that need it: while it is not imported, no model holds one of
    its blocks, and stand-in classes that nothing is an instance of take their place."""
    import sys
    from types import SimpleNamespace

    names = ("InvertedResidual", "InvertedResidualConfig", "BasicBlock", "Bottleneck", "EncoderBlock",
             "Conv2dNormActivation", "SqueezeExcitation")
    if "torchvision.models" not in sys.modules:
        return SimpleNamespace(**{n: type(n, (), {}) for n in names})
    from torchvision.models.mobilenetv3 import InvertedResidual, InvertedResidualConfig
    from torchvision.models.resnet import BasicBlock, Bottleneck
    from torchvision.models.vision_transformer import EncoderBlock
    from torchvision.ops.misc import Conv2dNormActivation, SqueezeExcitation

    return SimpleNamespace(InvertedResidual=InvertedResidual, InvertedResidualConfig=InvertedResidualConfig,
                           BasicBlock=BasicBlock, Bottleneck=Bottleneck, EncoderBlock=EncoderBlock,
                           Conv2dNormActivation=Conv2dNormActivation, SqueezeExcitation=SqueezeExcitation)


def _blocks() -> tuple:
    tv = _tv()
    return (tv.Conv2dNormActivation, tv.InvertedResidual, tv.BasicBlock, tv.Bottleneck, Residual, tv.EncoderBlock,
            LastStepLSTM)


class UnsupportedLayer(ValueError):
    """The server block starts with a layer the generator has no rule for."""


def first_layer(module: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The first module with parameters in forward order (a known block counts as one layer), and the
    parameter-free modules of ``nn.Sequential`` containers before it (pooling, flattening), which the auxiliary
    network keeps so that the replicated layer sees what the original sees."""
    if isinstance(module, _blocks() + _LAYERS + (nn.LayerNorm,)):
        return [], module
    prefix = []
    for child in module.children():
        if any(True for _ in child.parameters()):
            inner_prefix, layer = first_layer(child)
            return prefix + inner_prefix, layer
        if isinstance(module, nn.Sequential):
            prefix.append(child)
    if any(True for _ in module.parameters(recurse=False)):
        raise UnsupportedLayer(f"the server block starts with a {type(module).__name__}; the auxiliary-network "
                               f"generator knows: {', '.join(SUPPORTED)}")
    raise UnsupportedLayer("the server block has no layer with parameters to replicate")


def _scaled(n: int, ratio: float) -> int:
    return max(1, int(round(n * ratio)))


def _conv(conv: nn.Conv2d, out: int) -> nn.Conv2d:
    groups = math.gcd(conv.in_channels, out) if conv.groups > 1 else 1
    return nn.Conv2d(conv.in_channels, out, conv.kernel_size, conv.stride, conv.padding, conv.dilation, groups,
                     bias=conv.bias is not None)


def replicate(layer: nn.Module, ratio: float) -> nn.Module:
    """The first layer of the auxiliary network: ``layer`` at ``ratio x`` its output dimension (module docstring)."""
    tv = _tv()
    Conv2dNormActivation, InvertedResidual, EncoderBlock = tv.Conv2dNormActivation, tv.InvertedResidual, tv.EncoderBlock
    BasicBlock, Bottleneck = tv.BasicBlock, tv.Bottleneck
    if isinstance(layer, Conv2dNormActivation):
        conv = layer[0]
        out = _scaled(conv.out_channels, ratio)
        norm = next((type(m) for m in layer if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
        act = next((type(m) for m in layer if isinstance(m, (nn.ReLU, nn.ReLU6, nn.Hardswish, nn.SiLU))), None)
        return Conv2dNormActivation(conv.in_channels, out, conv.kernel_size, conv.stride, conv.padding,
                                    groups=math.gcd(conv.in_channels, out) if conv.groups > 1 else 1,
                                    norm_layer=norm, activation_layer=act, dilation=conv.dilation,
                                    bias=conv.bias is not None)
    if isinstance(layer, nn.Conv2d):
        return nn.Sequential(_conv(layer, _scaled(layer.out_channels, ratio)), nn.ReLU())
    if isinstance(layer, InvertedResidual):
        convs = [m for m in layer.block if isinstance(m, Conv2dNormActivation)]
        first, depthwise, project = convs[0][0], convs[-2][0], convs[-1][0]
        act = "HS" if any(isinstance(m, nn.Hardswish) for m in layer.modules()) else "RE"
        cnf = tv.InvertedResidualConfig(first.in_channels, depthwise.kernel_size[0], depthwise.out_channels,
                                     project.out_channels, any(isinstance(m, tv.SqueezeExcitation) for m in layer.modules()),
                                     act, depthwise.stride[0], depthwise.dilation[0], 1.0)
        # set after construction: the config would round the widths to multiples of 8, not ratio x
        cnf.input_channels = first.in_channels
        cnf.expanded_channels = _scaled(depthwise.out_channels, ratio)
        cnf.out_channels = _scaled(project.out_channels, ratio)
        return InvertedResidual(cnf, nn.BatchNorm2d)
    if isinstance(layer, (BasicBlock, Bottleneck)):
        cls = type(layer)
        planes = _scaled(layer.conv1.out_channels if cls is BasicBlock else layer.conv1.out_channels, ratio)
        inplanes, stride = layer.conv1.in_channels, layer.stride
        out = planes * cls.expansion
        down = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))
        return cls(inplanes, planes, stride, downsample=down)
    if isinstance(layer, Residual):
        return replicate(first_layer(layer.body)[1], ratio)
    if isinstance(layer, nn.LayerNorm):  # a head-only server block (a ViT cut before its head): nothing to scale
        return nn.LayerNorm(layer.normalized_shape, eps=layer.eps)
    if isinstance(layer, nn.Linear):
        return nn.Sequential(nn.Flatten(), nn.Linear(layer.in_features, _scaled(layer.out_features, ratio)), nn.ReLU())
    if isinstance(layer, LastStepLSTM):
        lstm = layer.lstm
        return LastStepLSTM(lstm.input_size, _scaled(lstm.hidden_size, ratio), lstm.num_layers)
    if isinstance(layer, EncoderBlock):
        dim = layer.ln_1.normalized_shape[0]
        width = _scaled(dim, ratio)
        heads = max(h for h in range(1, layer.num_heads + 1) if width % h == 0)
        mlp = layer.mlp[0].out_features
        return nn.Sequential(nn.Linear(dim, width), EncoderBlock(heads, width, _scaled(mlp, ratio), 0.0, 0.0))
    raise UnsupportedLayer(f"the server block starts with a {type(layer).__name__}; the auxiliary-network generator "
                           f"knows: {', '.join(SUPPORTED)}")


class _Pool(nn.Module):
    """Feature maps -> global average; tokens -> LayerNorm'd class token; vectors unchanged."""

    def __init__(self, kind: str, dim: int):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(dim, eps=1e-6) if kind == "tokens" else nn.Identity()

    def forward(self, x):
        if self.kind == "maps":
            return x.mean(dim=tuple(range(2, x.dim())))
        if self.kind == "tokens":
            return self.norm(x)[:, 0]
        return x.flatten(1)


def auxiliary_net(server_block: nn.Module, device_output_shape: tuple, num_classes: int, ratio: float = 0.5) -> nn.Sequential:
    """The auxiliary network for ``server_block`` fed with device-block outputs of ``device_output_shape`` (no
    batch dimension): the replicated first layer, pooling, a linear classifier."""
    if not 0 < ratio <= 1:
        raise ValueError(f"the dimension ratio must lie in (0, 1], got {ratio}")
    prefix, layer = first_layer(server_block)
    first = nn.Sequential(*[copy.deepcopy(m) for m in prefix], replicate(layer, ratio))
    was = first.training
    first.eval()
    with torch.no_grad():
        feats = first(torch.zeros(2, *device_output_shape))
    first.train(was)
    kind = "maps" if feats.dim() == 4 else "tokens" if feats.dim() == 3 else "vector"
    dim = feats.shape[1] if kind != "tokens" else feats.shape[-1]
    return nn.Sequential(first, _Pool(kind, dim), nn.Linear(dim, num_classes))
