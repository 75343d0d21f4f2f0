"""Privacy of tokens (issue 71, item 7): on a tiny GPT-2 (2 blocks of width 32, a 300-token vocabulary) the server's
token recovery from hidden states (nearest public embedding row, a learned inversion) and its next-token reading
of the returned gradients; the defences act on the hidden tensor; a run logs the privacy/* metrics; a bad
configuration is one error naming the key before any actor starts."""

from __future__ import annotations

import pytest
import torch

from helpers import make_config
from raysplit.errors import ConfigError
from raysplit.experiment import run_experiment
from raysplit.lm_metrics import lm_loss
from raysplit.models.causal_lm import HiddenStates, LMConfig, build_causal_lm
from raysplit.privacy import CutDefence, NoiseDefence, PrivacySpec, QuantizeDefence
from raysplit.token_privacy import (embedding_tables, head_rows, next_token_leak, nearest_tokens,
                                    token_accuracy, train_token_decoder)
from test_lm_runs import LM

V, T = 300, 48


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: two on the loaded 2-core machine made the decoder's training 40x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    model = build_causal_lm(LMConfig(family="gpt2", layers=2, width=32, heads=2, max_positions=T, vocab_size=V),
                            fixed_length=True)
    return model.eval()


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def defended(z: torch.Tensor, defence) -> torch.Tensor:
    torch.manual_seed(1)
    return CutDefence(PrivacySpec(defence=defence)).release(z)[0]


def test_nearest_embedding_at_cut_embed_recovers_the_tokens_and_strong_noise_stops_it(lm):
    x = ids(8, 0)
    with torch.no_grad():
        z = lm.blocks[0](x)  # cut embed: what the client sends is the token row plus the position row
    table, positions = embedding_tables(lm.blocks[0])
    assert token_accuracy(nearest_tokens(z, table, "cosine", positions), x) == 1.0
    assert token_accuracy(nearest_tokens(z, table, "l2", positions), x) == 1.0
    assert 0.8 < token_accuracy(nearest_tokens(z, table, "cosine"), x) < 1.0  # exact up to the positional term
    noisy = defended(z, NoiseDefence(kind="noise", sigma=0.3))  # std 0.3 against rows of std 0.02
    assert token_accuracy(nearest_tokens(noisy, table, "cosine", positions), x) < 0.2
    mild = defended(z, NoiseDefence(kind="noise", sigma=0.003))
    assert token_accuracy(nearest_tokens(mild, table, "cosine", positions), x) > 0.9


def test_defences_act_on_the_hidden_tensor_of_a_payload(lm):
    """Noise and quantization change a HiddenStates payload's hidden tensor only; mask and positions cross as
    they are, and quantization's bytes count them."""
    x = ids(2, 1)
    with torch.no_grad():
        hidden = lm.blocks[0](x)
    payload = HiddenStates(hidden, torch.ones_like(x), torch.arange(T).expand(2, -1))
    for defence in (NoiseDefence(kind="noise", sigma=0.1, clip=1.0), QuantizeDefence(kind="quantize", bits=2)):
        out, nbytes = CutDefence(PrivacySpec(defence=defence)).release(payload)
        assert isinstance(out, HiddenStates) and out.hidden.shape == hidden.shape
        assert not torch.equal(out.hidden, hidden)
        assert out.attention_mask is payload.attention_mask and out.positions is payload.positions
        if defence.kind == "quantize":
            assert out.hidden.round(decimals=5).unique().numel() <= 4  # 2 bits: four levels
            assert nbytes == (hidden.numel() * 2 + 7) // 8 + 8 + 2 * x.numel() * 8


def test_the_returned_gradient_names_the_next_token_on_an_untrained_model(lm):
    x = ids(4, 2)
    with torch.no_grad():
        h = lm.blocks[2](lm.blocks[1](lm.blocks[0](x)))  # the server's output: the tail is the head alone
    h.requires_grad_(True)
    lm_loss(lm.blocks[-1](h), x).backward()
    rows, norm_w = head_rows(lm.blocks[-1])
    leak = next_token_leak(h.grad, x, rows, norm_w)
    assert leak["next_token_leak"] > 0.9 and leak["next_token_top5"] >= leak["next_token_leak"]  # chance: 1/300
    shuffled = next_token_leak(h.grad, x.roll(1, dims=1), rows, norm_w)
    assert shuffled["next_token_leak"] < 0.05  # it reads this batch's next tokens, not any tokens


@pytest.mark.parametrize("std, least", [(0.0, 0.5), (0.05, 10 / V)])
def test_the_learned_inversion_beats_chance(lm, std, least):
    """At cut block1 (after a decoder block), a decoder trained on 64 public blocks encoded through the public
    base (and the same noise: rows have std 0.02) recovers an unseen victim's tokens far above chance (1/300)."""
    def sent(x, seed):
        with torch.no_grad():
            z = lm.blocks[1](lm.blocks[0](x))
        torch.manual_seed(seed)
        return z + std * torch.randn_like(z)

    public, victim = ids(64, 3), ids(8, 4)
    dec = train_token_decoder(sent(public, 5), public, V, epochs=20, hidden=256, seed=0)
    assert token_accuracy(dec.tokens(sent(victim, 6)), victim) > least


def test_the_attacks_run_in_a_tiny_lm_run_and_log_privacy_metrics(tmp_path, mlflow_uri):
    """A local U-shaped run at cut block1 with the noise defence (std 0.01, clipped at norm 2: an epsilon), the
    nearest-embedding attack and the next-token gradient attack: each logs its privacy/* metric in MLflow."""
    from mlflow.tracking import MlflowClient

    over = {**LM, "runtime.backend": "local", "train.rounds": 1, "train.local_steps": 2, "model.cut": "block1",
            "privacy.attack.kind": "nearest_embedding", "privacy.attack.samples": 16,
            "privacy.label_attack.kind": "next_token",
            "privacy.defence.kind": "noise", "privacy.defence.sigma": 0.005, "privacy.defence.clip": 2.0}
    final = run_experiment(make_config(tmp_path, mlflow_uri, **over))
    client = MlflowClient(mlflow_uri)
    for key in ("privacy/token_recovery", "privacy/next_token_leak", "privacy/next_token_top5", "privacy/epsilon"):
        assert len(client.get_metric_history(final["run_id"], key)) == 1, key
    assert final["privacy/token_recovery"] > 0.5  # noise of std 0.01 (rows: 0.02) after a block: most still read
    assert final["privacy/next_token_leak"] > 0.3  # after a round of training, far above chance (1/300)
    assert final["privacy/epsilon"] > 0  # a clipped Gaussian mechanism: counted (large at this little noise)


def test_the_learned_inversion_runs_under_quantization(tmp_path):
    over = {**LM, "runtime.backend": "local", "tracking.enabled": False, "train.rounds": 1,
            "privacy.attack.kind": "token_inversion", "privacy.attack.aux_size": 16, "privacy.attack.samples": 16,
            "privacy.attack.victims": 1, "privacy.defence.kind": "quantize", "privacy.defence.bits": 4}
    final = run_experiment(make_config(tmp_path, None, **over))
    assert 20 / V < final["privacy/token_recovery"] <= 1.0


@pytest.mark.parametrize("over, match", [
    ({"privacy.attack.kind": "nearest_embedding"}, r"^privacy\.attack\.kind=nearest_embedding recovers tokens from "
                                                    r"a language model's hidden states \(model\.lm\)"),
    ({"privacy.attack.kind": "token_inversion"}, r"^privacy\.attack\.kind=token_inversion recovers tokens"),
    ({"privacy.label_attack.kind": "next_token", "model.tail_cut": "conv2"},
     r"^privacy\.label_attack\.kind=next_token reads next tokens against a language model's LM head"),
])
def test_a_token_attack_on_an_image_model_is_one_error_naming_the_key(tmp_path, over, match):
    cfg = make_config(tmp_path, None, **{"algorithm.name": "splitnn", "runtime.backend": "local",
                                         "tracking.enabled": False, **over})
    with pytest.raises(ConfigError, match=match):
        run_experiment(cfg)


@pytest.mark.parametrize("over, match", [
    ({"privacy.label_attack.kind": "next_token", "model.lm.layers": 3, "model.lm.heads": 2, "model.cut": "block1",
      "model.tail_cut": "block2"}, r"^model\.tail_cut='block2': privacy\.label_attack\.kind=next_token .* the head "
                                   r"alone \(model\.tail_cut='block3'"),
    ({"privacy.label_attack.kind": "next_token", "model.lm.split": "plain"},
     r"^privacy\.label_attack\.kind=next_token: .* sends the labels to the server.*model\.lm\.split=u_shaped"),
    ({"privacy.attack.kind": "nearest_embedding", "model.lm.split": "plain"},
     r"^privacy\.attack\.kind=nearest_embedding: model\.lm\.split=plain sends the token blocks"),
    ({"privacy.label_attack.kind": "gradient_scoring"}, r"^privacy\.label_attack\.kind=gradient_scoring .* use "
                                                         r"privacy\.label_attack\.kind=next_token"),
    ({"privacy.attack.kind": "reconstruction"}, r"^privacy\.attack\.kind=reconstruction scores images .* \(a "
                                                 r"language model: nearest_embedding, token_inversion\)"),
    ({"privacy.attack.kind": "nearest_embedding", "algorithm.name": "fedavg"},
     r"^privacy\.attack\.kind: fedavg sends no activations"),
])
def test_a_token_attack_where_it_cannot_apply_is_one_error_naming_the_key(tmp_path, monkeypatch, over, match):
    """Each refused before any actor or host is made (the local backend's hosts would be built next)."""
    from raysplit.runtime.client import host

    monkeypatch.setattr(host.ClientHost, "__init__", lambda *a, **k: pytest.fail("a host was started"))
    cfg = make_config(tmp_path, None, **{**LM, "runtime.backend": "local", "tracking.enabled": False, **over})
    with pytest.raises(ConfigError, match=match):
        run_experiment(cfg)
