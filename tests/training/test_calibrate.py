"""Offline calibration of DSpark's confidence head (training/calibrate.py, `offline_calibration`):
teacher-forced confidences against the soft acceptance label the loss trains them on."""

import torch

from specdecode.training.calibrate import offline_calibration
from specdecode.training.data import collate, load_sequences, plan_batches
from specdecode.training.features import TargetFeatures
from specdecode.training.run import make_task
from specdecode.training.trainer import TrainConfig

# 16 anchors in 24-token answers: some blocks run past an answer's end (labels of weight 0)
KW = {"draft_vocab_size": 128, "num_layers": 1, "block_size": 4, "num_anchors": 16}


def test_offline_calibration_scores_the_head_against_the_losss_labels(make_regen, tmp_path):
    target, regen = make_regen("conf", 8, "count the boats and the oars number {}")
    seqs = load_sequences(regen, "train", 512, target.fingerprint)
    task = make_task("dspark", target, seqs, tmp_path, TrainConfig(out_dir=str(tmp_path)), KW)
    rows = offline_calibration(task, target, seqs, tokens_per_batch=256, max_batches=1)
    assert [r["position"] for r in rows] == [1, 2, 3, 4] and all(r["n"] > 0 for r in rows)
    # Each position's label is the loss's own expected acceptance there (its weighted mean),
    # on the same batch: the rows kept and the labels read are the loss's.
    batch = collate([seqs[j] for j in plan_batches([len(s.input_ids) for s in seqs], 256, 0, 0)[0]])
    feats = TargetFeatures(target, task.feature_layers)(batch)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the anchors offline_calibration drew for its first batch
        _, logs = task.module(batch, feats)
    for j in (0, 1, 3):  # positions 1, 2 and 4 (labels past an answer's end weigh 0 there)
        assert abs(rows[j]["label"] - logs[f"accept_{j}"]) < 1e-5, j
    # A constant head reads an ECE of its distance to the mean label; a head that predicts the
    # mean label reads none.
    with torch.no_grad():
        task.net.conf.weight.zero_()
        for bias in (3.0, float(torch.logit(torch.tensor(rows[0]["label"])))):
            task.net.conf.bias.fill_(bias)
            got = offline_calibration(task, target, seqs, tokens_per_batch=256, max_batches=1)[0]
            want = abs(float(torch.sigmoid(torch.tensor(bias))) - rows[0]["label"])
            assert (
                abs(got["ece"] - want) < 1e-5
                and abs(got["confidence"] - float(torch.sigmoid(torch.tensor(bias)))) < 1e-6
            )
