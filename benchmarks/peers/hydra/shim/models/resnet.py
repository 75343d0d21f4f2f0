"""Stand-in for Hydra's missing ``models/resnet.py``: their get_models.py imports ``get_resnet_split`` at module
level, so the import must succeed; the parity runner only uses the MobileNetV1 path (``--model_name mobilenet``)."""


def get_resnet_split(*args, **kwargs):
    raise NotImplementedError("models/resnet.py is missing from Hydra's repository; the parity runner only "
                              "supports --model_name mobilenet (see benchmarks/peers/hydra/shim/models/mobilenet.py)")
