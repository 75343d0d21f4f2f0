"""Tests for raysplit.models: every registered model splits at every cut into parts that compose to the model."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from raysplit.models import (
    MODELS,
    ModelInfo,
    SplitModel,
    build_model,
    count_parameters,
    param_bytes,
    register_model,
)

ALL = sorted(MODELS)
HEAVY = {"resnet101", "vgg16_bn_gas", "mobilenet_v3_large", "alexnet2"}

EXPECTED_MODELS = {
    "cnn_small", "cnn_gap", "femnist_cnn", "celeba_cnn", "shakespeare_lstm", "resnet9", "alexnet_gas", "vgg16_bn_gas",
    "semisfl_cnn", "alexnet2", "mobilenet_v1", "mobilenet_v3_large", "resnet18", "resnet101", "vit_small",
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tests run many small forwards; on a shared 2-core machine one intra-op thread is several times faster
    (multi-threaded oneDNN kernels stall when the other core is busy). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def _built(name: str, num_classes: int = 7) -> SplitModel:
    """One eval-mode instance per model (seeded), shared by the read-only tests."""
    torch.manual_seed(0)
    return build_model(name, num_classes).eval()


def _input(model: SplitModel, batch: int = 2) -> torch.Tensor:
    return model.example_input(batch, generator=torch.Generator().manual_seed(1))


def test_registry_has_every_model():
    assert EXPECTED_MODELS <= set(MODELS)
    for name, info in MODELS.items():
        assert isinstance(info, ModelInfo) and info.name == name
        assert info.input_kind in ("image", "tokens")
        assert info.description


# ------------------------------------------------------------------------------------------------------------
# Composition: server(client(x)) == model(x) for every model and every cut
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in ALL])
def test_split_composes_at_every_cut(name):
    model = _built(name)
    x = _input(model)
    cuts = sorted(set(model.cut_points().values()))
    assert cuts == list(range(1, len(model.blocks))), "every index 1..n-1 must be a named cut"
    with torch.no_grad():
        full = model(x)
        assert full.shape == (2, 7)
        assert torch.isfinite(full).all()
        for k in cuts:
            client, server = model.split(k)
            assert len(client) == k and len(server) == len(model.blocks) - k
            act = client(x)
            out = server(act)
            torch.testing.assert_close(out, full, msg=lambda m, k=k: f"{name} cut {k}: {m}")


@pytest.mark.parametrize("name", ["cnn_small", "resnet9", "mobilenet_v1", "alexnet_gas", "shakespeare_lstm"])
def test_split3_composes(name):
    model = _built(name)
    x = _input(model)
    n = len(model.blocks)
    pairs = [(1, n - 1), (1, 2), (n - 2, n - 1)]
    if name == "mobilenet_v1":
        pairs.append((4, 23))  # Hydra's scripts: cut_a=4, cut_b=23
    with torch.no_grad():
        full = model(x)
        for a, b in pairs:
            if not 1 <= a < b <= n - 1:
                continue
            p1, p2, p3 = model.split3(a, b)
            assert (len(p1), len(p2), len(p3)) == (a, b - a, n - b)
            torch.testing.assert_close(p3(p2(p1(x))), full, msg=lambda m: f"{name} split3({a},{b}): {m}")


def test_split3_requires_ordered_cuts():
    model = _built("cnn_small")
    with pytest.raises(ValueError):
        model.split3(2, 2)
    with pytest.raises(ValueError):
        model.split3("fc1", "conv1")
    with pytest.raises(ValueError):
        model.split3(1, 999)


def test_hydra_mobilenet_layout():
    model = _built("mobilenet_v1")
    assert len(model.blocks) == 29  # stem + 13 x (dw, pw) + pool + fc
    convs = [n for n in model.block_names if n == "stem" or n[:2] in ("dw", "pw")]
    assert len(convs) == 27
    _, body, head = model.split3(4, 23)
    names = [model.block_names[int(i)] for i, _ in head.named_children()]
    assert names == ["dw12", "pw12", "dw13", "pw13", "pool", "fc"]


# ------------------------------------------------------------------------------------------------------------
# Split-learning training pattern: detached activation on the server, gradient sent back to the client
# ------------------------------------------------------------------------------------------------------------
def _split_step_grads(model: SplitModel, cut, x, y):
    client, server = model.split(cut)
    model.zero_grad(set_to_none=True)
    act = client(x)
    recv = act.detach().requires_grad_(True)  # what the server receives
    loss = nn.functional.cross_entropy(server(recv), y)
    loss.backward()
    act.backward(recv.grad)  # the gradient goes back to the client
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    return grads, loss.detach()


@pytest.mark.parametrize("name", ["cnn_small", "resnet9", "femnist_cnn", "celeba_cnn", "alexnet_gas", "shakespeare_lstm",
                                  "semisfl_cnn", *(pytest.param(n, marks=pytest.mark.slow)
                                                   for n in ("resnet18", "mobilenet_v1"))])  # ~5 s each
def test_split_training_gradients_equal_full_model(name):
    """Dropout-free models, train mode: the split step gives exactly the full model's gradients at every cut
    (this also catches in-place ops at a block boundary, which would fail on the detached activation)."""
    torch.manual_seed(0)
    model = build_model(name, 5).train()
    x = model.example_input(4, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2, 3])
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    model.zero_grad(set_to_none=True)
    loss_full = nn.functional.cross_entropy(model(x), y)
    loss_full.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for k in sorted(set(model.cut_points().values())):
        model.load_state_dict(snapshot)  # undo BatchNorm running-stat updates
        grads, loss = _split_step_grads(model, k, x, y)
        torch.testing.assert_close(loss, loss_full.detach())
        assert grads.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], msg=lambda m, n=n, k=k: f"{name} cut {k} grad {n}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HEAVY))
def test_split_training_pattern_runs_on_heavy_models(name):
    """The detach/requires_grad pattern works at the default cut and at the first and last cuts; every
    parameter on both sides receives a gradient."""
    torch.manual_seed(0)
    model = build_model(name, 3).train()
    x = model.example_input(2, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 2])
    n = len(model.blocks)
    for k in sorted({1, model.default_cut, n - 1}):
        grads, loss = _split_step_grads(model, k, x, y)
        assert torch.isfinite(loss)
        missing = [p for p, g in grads.items() if g is None]
        assert not missing


# ------------------------------------------------------------------------------------------------------------
# Cut resolution
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_resolve_cut_by_name_and_index_agree(name):
    model = _built(name)
    cuts = model.cut_points()
    n = len(model.blocks)
    for k in range(1, n):
        assert model.resolve_cut(k) == k
        assert model.resolve_cut(str(k)) == k
        assert cuts[model.block_names[k - 1]] == k  # a cut is named after the last client block
    for cut_name, k in cuts.items():
        assert model.resolve_cut(cut_name) == k
        c_by_name, s_by_name = model.split(cut_name)
        c_by_idx, _ = model.split(k)
        assert [id(m) for m in c_by_name] == [id(m) for m in c_by_idx]
        assert len(c_by_name) + len(s_by_name) == n
    assert model.resolve_cut(MODELS[name].default_cut) == model.default_cut


@pytest.mark.parametrize("bad", [999, 0, -1, "nope", "999", None, 2.5, True])
def test_bad_cut_raises_and_lists_valid_cuts(bad):
    model = _built("resnet18")
    with pytest.raises(ValueError) as err:
        model.resolve_cut(bad)
    msg = str(err.value)
    for cut_name, k in model.cut_points().items():
        assert cut_name in msg
        assert str(k) in msg
    with pytest.raises(ValueError):
        model.split(bad)


def test_named_cuts_match_papers():
    # GAS AlexNet: L1..L4 after conv1 / conv2 / conv3 / conv5; activation sizes as in seed-code §1.1
    alex = _built("alexnet_gas")
    assert [alex.resolve_cut(f"L{i}") for i in range(1, 5)] == [1, 2, 3, 5]
    assert alex.default_cut == 2
    assert [alex.activation_shape(f"L{i}") for i in range(1, 5)] == [(32, 16, 16), (64, 8, 8), (128, 8, 8),
                                                                   (256, 3, 3)]
    # GAS VGG16-BN: L1..L4 after conv 4 / 7 / 10 / 13; L1 outputs 128x8x8
    vgg = _built("vgg16_bn_gas")
    assert [vgg.resolve_cut(f"L{i}") for i in range(1, 5)] == [4, 7, 10, 13]
    assert vgg.activation_shape("L1") == (128, 8, 8)
    assert vgg.activation_shape("L4") == (512, 1, 1)
    conv_count = sum(isinstance(m, nn.Conv2d) for m in vgg.split("L1")[0].modules())
    assert conv_count == 4
    # CycleSL ResNet9: default cut 3 -> 128x16x16; LEAF models' default cuts
    assert _built("resnet9").default_cut == 3
    assert _built("resnet9").activation_shape(3) == (128, 16, 16)
    assert _built("femnist_cnn").activation_shape(2) == (64, 7, 7)
    assert _built("celeba_cnn").activation_shape(2) == (32, 21, 21)
    lstm = _built("shakespeare_lstm")
    assert lstm.default_cut == 2 and lstm.activation_shape(2) == (256,)  # last time step only
    # Semi-SFL: all convs on the client, flat embeddings
    assert _built("semisfl_cnn").activation_shape("features") == (1600,)
    assert _built("alexnet2").activation_shape("features") == (4096,)
    # ResNet18: named layers
    r18 = _built("resnet18")
    assert r18.resolve_cut("stem") == 1
    assert r18.resolve_cut("layer1") == r18.resolve_cut("layer1.1") == 3
    assert r18.resolve_cut("layer2") == 5 and r18.resolve_cut("layer3") == 7
    assert r18.activation_shape("layer1") == (64, 32, 32)  # CIFAR stem: no downsampling before layer2
    r101 = _built("resnet101")
    assert r101.resolve_cut("layer1") == 4 and r101.resolve_cut("layer3") == 1 + 3 + 4 + 23
    assert len(r101.blocks) == 1 + 3 + 4 + 23 + 3 + 1


# ------------------------------------------------------------------------------------------------------------
# Shared parameters, sizes
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cnn_small", "resnet18", "shakespeare_lstm", "mobilenet_v1"])
def test_split_parts_share_parameters(name):
    torch.manual_seed(0)
    model = build_model(name, 4)
    client, server = model.split(model.default_cut)
    full_ptrs = {p.data_ptr() for p in model.parameters()}
    part_params = list(client.parameters()) + list(server.parameters())
    assert len(part_params) == len(list(model.parameters()))
    assert {id(p) for p in part_params} == {id(p) for p in model.parameters()}
    assert {p.data_ptr() for p in part_params} == full_ptrs
    assert count_parameters(client) + count_parameters(server) == count_parameters(model)
    # Part state_dict keys map onto the full model's keys with a "blocks." prefix.
    full_sd = model.state_dict()
    for part in (client, server):
        for key, value in part.state_dict().items():
            assert full_sd["blocks." + key].data_ptr() == value.data_ptr()
    # A change through a part is visible in the full model.
    with torch.no_grad():
        next(client.parameters()).add_(1.0)
    first = next(model.parameters())
    assert first.data_ptr() == next(client.parameters()).data_ptr()


def test_count_parameters_and_param_bytes():
    lin = nn.Linear(3, 4)  # 12 + 4
    assert count_parameters(lin) == 16
    assert param_bytes(lin) == 16 * 4
    assert param_bytes(lin.to(torch.float64)) == 16 * 8
    bn = nn.BatchNorm1d(5)  # 10 params, buffers: 5 + 5 floats + 1 int64
    assert count_parameters(bn) == 10
    assert param_bytes(bn) == 40
    assert param_bytes(bn, include_buffers=True) == 40 + 40 + 8
    shared = nn.Sequential(lin, lin)
    assert count_parameters(shared) == 16
    frozen = nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    assert count_parameters(frozen, trainable_only=True) == 4


# ------------------------------------------------------------------------------------------------------------
# build_model
# ------------------------------------------------------------------------------------------------------------
def test_unknown_model_lists_registered_names():
    with pytest.raises(ValueError) as err:
        build_model("no_such_model", 10)
    for name in EXPECTED_MODELS:
        assert name in str(err.value)


@pytest.mark.parametrize("num_classes", [1, 3, 100])
@pytest.mark.parametrize("name", ["cnn_small", "femnist_cnn", "resnet9", "shakespeare_lstm", "mobilenet_v1",
                                  "alexnet_gas", "semisfl_cnn"])
def test_num_classes_respected(name, num_classes):
    torch.manual_seed(0)
    model = build_model(name, num_classes).eval()
    with torch.no_grad():
        out = model(_input(model))
    assert out.shape == (2, num_classes)


def test_bad_num_classes_and_input_shape():
    with pytest.raises(ValueError):
        build_model("cnn_small", 0)
    with pytest.raises(ValueError):
        build_model("cnn_small", 10, input_shape=(28, 28))
    with pytest.raises(ValueError):
        build_model("vgg16_bn_gas", 10, input_shape=(3, 8, 8))  # too small for five 2x2 pools


@pytest.mark.parametrize("shape,act", [((1, 28, 28), (32, 7, 7)), ((1, 8, 8), (32, 4, 4)), ((3, 32, 32), (32, 8, 8))])
def test_cnn_small_input_sizes(shape, act):
    torch.manual_seed(0)
    model = build_model("cnn_small", 10, input_shape=shape).eval()
    assert model.input_shape == shape
    x = torch.randn(2, *shape)
    with torch.no_grad():
        full = model(x)
        client, server = model.split("conv2")
        mid = client(x)
        assert tuple(mid.shape[1:]) == act == model.activation_shape("conv2")
        torch.testing.assert_close(server(mid), full)
    assert full.shape == (2, 10)
    wrong = torch.randn(2, shape[0], 12, 12)  # an input size the model was not built for
    with pytest.raises(RuntimeError):
        model(wrong)


def test_seed_determines_weights():
    torch.manual_seed(5)
    a = build_model("resnet9", 10)
    torch.manual_seed(5)
    b = build_model("resnet9", 10)
    torch.manual_seed(6)
    c = build_model("resnet9", 10)
    for (ka, va), (_, vb), (_, vc) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert torch.equal(va, vb), ka
    assert not all(torch.equal(va, vc) for va, vc in zip(a.parameters(), c.parameters()))


def test_other_input_sizes():
    torch.manual_seed(0)
    for name, shape in [("resnet18", (3, 64, 64)), ("resnet9", (3, 64, 64)), ("femnist_cnn", (1, 32, 32)),
                        ("alexnet_gas", (1, 28, 28)), ("mobilenet_v1", (3, 64, 64))]:
        model = build_model(name, 4, input_shape=shape).eval()
        with torch.no_grad():
            x = torch.randn(2, *shape)
            full = model(x)
            client, server = model.split(model.default_cut)
            torch.testing.assert_close(server(client(x)), full)
        assert full.shape == (2, 4)


def test_register_model_decorator_and_builder_contract():
    name = "_test_tiny_mlp"

    @register_model(name, input_shape=(4,), input_kind="image", default_cut="h", description="test only")
    def tiny(num_classes, input_shape):
        return SplitModel([("h", nn.Sequential(nn.Linear(input_shape[0], 3), nn.ReLU())),
                           ("out", nn.Linear(3, num_classes))])

    try:
        model = build_model(name, 2)
        assert model.name == name and model.default_cut == 1 and model.input_shape == (4,)
        assert model.cut_points() == {"h": 1}
        with pytest.raises(ValueError):
            register_model(name, input_shape=(4,), default_cut=1, description="dup")(tiny)
    finally:
        MODELS.pop(name, None)
    with pytest.raises(ValueError):
        SplitModel([("only", nn.Identity())])
    with pytest.raises(ValueError):
        SplitModel([("a", nn.Identity()), ("a", nn.Identity())])
    with pytest.raises(ValueError):
        SplitModel([("a", nn.Identity()), ("b", nn.Identity())], aliases={"x": "b"})  # "b" is not a cut


def test_cnn_gap_heads_are_the_shares_its_docstring_states():
    """Hydra's head-share study relies on these shares of the server part (cut after conv1)."""
    m = _built("cnn_gap", num_classes=10)
    n = {name: sum(p.numel() for p in b.parameters()) for name, b in zip(m.block_names, m.blocks)}
    server = sum(v for k, v in n.items() if k != "conv1")
    assert server == 60714
    assert round(100 * n["fc"] / server, 1) == 1.1
    assert round(100 * (n["conv4"] + n["fc"]) / server) == 62
    assert round(100 * (n["conv3"] + n["conv4"] + n["fc"]) / server) == 92
