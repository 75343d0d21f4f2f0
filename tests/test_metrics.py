import numpy as np
import pytest
from sklearn.metrics import f1_score, matthews_corrcoef

from raysplit import metrics as M


def test_per_label_accuracy_and_gap_by_hand():
    y = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    p = np.array([0, 0, 0, 1, 1, 0, 2, 2])
    la = M.per_label_accuracy(y, p, 4)
    assert la[:3] == pytest.approx([0.75, 0.5, 1.0]) and np.isnan(la[3])
    # PG = max - mean over labels present = 1.0 - 0.75
    assert M.performance_gap(la) == pytest.approx(0.25)


def test_backward_transfer_by_hand():
    hist = np.array([[0.9, 0.1, 0.5],
                     [0.2, 0.8, 0.5],
                     [0.4, 0.6, 0.7]])
    # peaks over earlier evaluations: 0.9, 0.8, 0.5; finals 0.4, 0.6, 0.7; drops 0.5, 0.2, -0.2
    assert M.backward_transfer(hist) == pytest.approx((0.5 + 0.2 - 0.2) / 3)
    assert M.backward_transfer(hist[:1]) == 0.0


def test_f1_and_mcc_match_hand_values():
    y = np.array([0, 0, 1, 1])
    p = np.array([0, 1, 1, 1])
    m = M.classification_metrics(y, p, 2, loss_sum=2.0)
    # class 0: P=1, R=.5, F1=2/3; class 1: P=2/3, R=1, F1=.8 -> macro (2/3+.8)/2
    assert m["f1_macro"] == pytest.approx((2 / 3 + 0.8) / 2)
    # MCC = (TP*TN - FP*FN)/sqrt(...) with TP=2, TN=1, FP=1, FN=0 -> 2/sqrt(3*2*1*2)
    assert m["mcc"] == pytest.approx(2 / np.sqrt(12))
    assert m["accuracy"] == 0.75 and m["loss"] == 0.5
    assert m["f1_macro"] == pytest.approx(f1_score(y, p, average="macro"))
    assert m["mcc"] == pytest.approx(matthews_corrcoef(y, p))


def test_metric_names_are_grouped_and_the_old_names_map_back():
    """MLflow groups a run's charts by the prefix before "/": every metric raysplit logs has one, and each old
    short name (what stores written before hold) maps to its grouped name and back."""
    from raysplit.metrics import GROUPED, grouped, grouped_name, short_name

    assert grouped_name("accuracy") == "eval/accuracy" and grouped_name("train_loss") == "train/loss"
    assert grouped_name("label_acc_3") == "eval/label_acc/3"
    assert grouped_name("position_acc_12") == "eval/position_acc/12"
    assert grouped_name("bytes_up_activations") == "comm/bytes_up_activations"
    assert grouped_name("ks") == "method/ks" and grouped_name("eval/accuracy") == "eval/accuracy"
    assert grouped_name("sim_time") == "time/sim" and grouped_name("final_best_accuracy") == "summary/best_accuracy"
    for old in [*GROUPED, "label_acc_0", "position_acc_9", "bytes_down_gradients", "mask_rate", "server_epochs"]:
        assert short_name(grouped_name(old)) == old, old
    assert len(set(GROUPED.values())) == len(GROUPED)  # no two old names share a new one
    assert list(grouped({"accuracy": 1.0, "ks": 2})) == ["eval/accuracy", "method/ks"]
