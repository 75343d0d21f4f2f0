"""raysplit model zoo: split-able models with named cut points.

A :class:`SplitModel` is an ordered list of blocks; cut index ``k`` puts ``blocks[:k]`` on the client and
``blocks[k:]`` on the server. ``model.split(cut)`` returns ``(client, server)`` Sequentials that share the model's
modules, with ``server(client(x)) == model(x)``. Every model returns logits.

Registered models (``build_model(name, num_classes, input_shape=None, **kwargs)``):

=====================  ===============  ==========================================================  ============
name                   default input    blocks (cut names = block names + aliases)                  default cut
=====================  ===============  ==========================================================  ============
cnn_small              1x28x28 (8x8)    conv1 conv2 fc1 fc2                                         conv2 (2)
femnist_cnn            1x28x28          conv1 conv2 fc1 fc2                       (CycleSL, LEAF)   2
celeba_cnn             3x84x84          conv1..conv4 fc                           (CycleSL, LEAF)   2
shakespeare_lstm       80 tokens        embedding lstm fc                         (CycleSL, LEAF)   2
resnet9                3x32x32          conv1 conv2 res1 conv3 conv4 res2 classifier  (CycleSL)     3 (res1)
alexnet_gas            3x32x32          conv1..conv5 fc1..fc3; L1..L4 = conv1/2/3/5   (GAS)         L2 (2)
vgg16_bn_gas           3x32x32          conv1..conv13 fc1..fc3; L1..L4 = conv4/7/10/13 (GAS)        L2 (7)
semisfl_cnn            3x32x32          conv1 conv2 fc1 fc2; features = conv2     (Semi-SFL)        features (2)
alexnet2               3x32x32          conv1..conv5 fc1..fc3; features = conv5   (Semi-SFL)        features (5)
mobilenet_v1           3x32x32          stem dw1 pw1 .. dw13 pw13 pool fc         (Hydra)           4
mobilenet_v3_large     3x32x32          features.0..features.16 pool classifier   (torchvision)     features.3
resnet18 / resnet101   3x32x32          stem layer1.0 .. layer4.N head; aliases layer1..layer4      layer1
=====================  ===============  ==========================================================  ============

Language models (:mod:`.causal_lm`, not in the registry above: built from a ``model.lm`` section with
:func:`build_causal_lm`): GPT-2 and Llama from ``transformers``, blocks ``embed block1 .. blockN head``, a
:class:`HiddenStates` payload at the cut, LoRA adapters through ``peft`` (:mod:`.adapters`).

Nothing here imports Ray or MLflow.
"""

from .core import (
    MODELS,
    LastStepLSTM,
    ModelInfo,
    Residual,
    SplitModel,
    UClient,
    build_model,
    end_to_end,
    count_parameters,
    flat_dim,
    infer_output_shape,
    param_bytes,
    register_model,
)

from .adapters import AdapterConfig, apply_adapters, load_trainable_state, trainable_state
from .causal_lm import (
    CausalLM,
    HiddenStates,
    LMConfig,
    Tokens,
    build_causal_lm,
    generate,
)

# Importing the model modules registers their models.
from . import small as _small  # noqa: F401,E402
from . import gas as _gas  # noqa: F401,E402
from . import resnets as _resnets  # noqa: F401,E402
from . import mobilenets as _mobilenets  # noqa: F401,E402
from . import vit as _vit  # noqa: F401,E402

__all__ = [
    "AdapterConfig",
    "CausalLM",
    "HiddenStates",
    "LMConfig",
    "Tokens",
    "apply_adapters",
    "build_causal_lm",
    "generate",
    "load_trainable_state",
    "trainable_state",
    "MODELS",
    "LastStepLSTM",
    "ModelInfo",
    "Residual",
    "SplitModel",
    "UClient",
    "build_model",
    "end_to_end",
    "count_parameters",
    "flat_dim",
    "infer_output_shape",
    "param_bytes",
    "register_model",
]
