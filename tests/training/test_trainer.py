"""Methods trained side by side (`specdecode train A,B`, trainer.train_many): one target forward
per step for all, and the same weights as each trained alone, also across a resume."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specdecode.drafters.checkpoint import load_checkpoint
from specdecode.errors import SpecDecodeError
from specdecode.training.data import load_sequences
from specdecode.training.features import TargetFeatures
from specdecode.training.run import make_task, run_training, warm_start
from specdecode.training.trainer import TrainConfig

KW = {"eagle": {"draft_vocab_size": 128, "ttt_steps": 2}, "medusa": {"draft_vocab_size": 128, "num_heads": 2}}


@pytest.fixture(scope="module")
def data(make_regen):
    return make_regen("pair", 16, "name the rivers and the hills number {}")


def cfg(out, **kw) -> TrainConfig:
    base = dict(out_dir=str(out), steps=6, lr=3e-3, warmup_steps=2, tokens_per_batch=256, eval_prompts=0)
    return TrainConfig(**{**base, **kw})


def weights(run_dir) -> dict:
    return load_file(str(run_dir / "model.safetensors"))


def test_methods_trained_together_match_each_alone_with_one_target_forward_a_step(
    data, tmp_path, monkeypatch
):
    target, regen = data
    calls = []
    forward = TargetFeatures.__call__
    monkeypatch.setattr(
        TargetFeatures, "__call__", lambda self, b: calls.append(self.layers) or forward(self, b)
    )
    both = tmp_path / "both"
    res = run_training("eagle,medusa", target, regen, both, cfg(both), KW, progress=False)
    assert len(res) == 2 and all(r["step"] == 6 for r in res)
    assert len(calls) == 6  # one feature forward per step, read by both losses
    assert set(calls[0]) >= {
        -1,
        *json.loads((both / "eagle" / "config.json").read_text())["arch"]["feature_layers"],
    }
    for m in KW:
        calls.clear()
        run_training(m, target, regen, tmp_path / m, cfg(tmp_path / m), KW[m], progress=False)
        assert len(calls) == 6
        alone, together = weights(tmp_path / m), weights(both / m)
        assert alone.keys() == together.keys()
        for k in alone:
            torch.testing.assert_close(together[k], alone[k], rtol=0, atol=0, msg=f"{m}: {k}")
        card = json.loads((both / m / "config.json").read_text())["training"]
        assert card["trained_with"] == ["eagle", "medusa"] and card["steps"] == 6


def test_methods_trained_together_resume_to_the_same_weights(data, tmp_path):
    target, regen = data
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_training("eagle,medusa", target, regen, full, cfg(full), KW, progress=False)
    stopped = run_training("eagle,medusa", target, regen, cut, cfg(cut, stop_at=3), KW, progress=False)
    assert [r["stopped_at"] for r in stopped] == [3, 3]
    run_training("eagle,medusa", target, regen, cut, cfg(cut), KW, progress=False)
    for m in KW:
        a, b = weights(full / m), weights(cut / m)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=f"{m}: {k}")


def test_methods_trained_together_refuse_what_they_cannot_share(data, tmp_path):
    target, regen = data
    with pytest.raises(SpecDecodeError, match="once"):
        run_training("eagle,eagle", target, regen, tmp_path, cfg(tmp_path), KW, progress=False)
    mtp_native = {**KW, "mtp": {"draft_vocab_size": 128, "mode": "native"}}
    with pytest.raises(SpecDecodeError, match="on its own"):
        run_training("eagle,mtp", target, regen, tmp_path, cfg(tmp_path), mtp_native, progress=False)


def test_a_time_limit_saves_and_stops_like_a_kill(data, tmp_path):
    target, regen = data
    out = tmp_path / "boxed"
    res = run_training("eagle", target, regen, out, cfg(out, time_limit_s=0.0), KW["eagle"], progress=False)
    assert res["stopped_at"] == 1 and (out / "trainer.pt").exists()
    res = run_training("eagle", target, regen, out, cfg(out), KW["eagle"], progress=False)
    assert res["step"] == 6


def test_a_time_annealed_run_decays_its_learning_rate_to_the_time_limit(data, tmp_path):
    target, regen = data
    logged = {}
    for anneal in (False, True):
        out = tmp_path / f"anneal-{anneal}"
        boxed = cfg(out, time_limit_s=1e-6, anneal_to_time_limit=anneal, log_every=1)
        res = run_training("eagle", target, regen, out, boxed, KW["eagle"], progress=False)
        assert res["stopped_at"] == 1
        logged[anneal] = json.loads((out / "log.jsonl").read_text().splitlines()[0])["lr"]
    lr, floor = cfg(tmp_path).lr, cfg(tmp_path).lr * cfg(tmp_path).min_lr_ratio
    assert logged[False] == pytest.approx(lr / 2)  # warm-up: step 1 of 2, the time limit ignored
    assert logged[True] == pytest.approx(floor)  # the whole time limit spent: the schedule's end


def test_init_from_starts_each_method_from_a_checkpoint_and_refuses_another_architecture(data, tmp_path):
    target, regen = data
    first = tmp_path / "first"
    run_training("eagle,medusa", target, regen, first, cfg(first), KW, progress=False)
    for m in KW:  # the warm-started task holds exactly the checkpoint's weights
        task = make_task(
            m, target, load_sequences(regen, "train", 512, target.fingerprint), tmp_path, cfg(tmp_path), KW[m]
        )
        warm_start(task, first / m, *load_checkpoint(first / m, m, target))
        saved = weights(first / m)
        for k, t in task.checkpoint_state().items():
            torch.testing.assert_close(t.to(saved[k].dtype), saved[k], rtol=0, atol=0, msg=f"{m}: {k}")
    second = tmp_path / "second"
    run_training(
        "eagle,medusa", target, regen, second, cfg(second, steps=2), KW, progress=False, init_from=first
    )
    card = json.loads((second / "eagle" / "config.json").read_text())["training"]
    assert card["init_from"] == str(first / "eagle")
    other = {**KW["eagle"], "draft_vocab_size": 64}
    with pytest.raises(SpecDecodeError, match="draft_vocab_size"):
        run_training(
            "eagle",
            target,
            regen,
            tmp_path / "x",
            cfg(tmp_path / "x"),
            other,
            progress=False,
            init_from=first / "eagle",
        )


def test_a_warm_start_trains_on_the_vocabulary_its_head_was_trained_on(data, tmp_path, monkeypatch):
    """The labels (the target's logits over the draft vocabulary) and the warm-started head must
    index the same ids, whatever vocabulary the new data would pick."""
    import specdecode.training.run as run_mod

    target, regen = data
    first = tmp_path / "first"
    kw = {"draft_vocab_size": 32, "ttt_steps": 2}
    run_training("eagle", target, regen, first, cfg(first), kw, progress=False)
    other = tmp_path / "other"  # a few answers: their most frequent tokens are another vocabulary
    other.mkdir()
    (other / "meta.json").write_text((regen / "meta.json").read_text())
    (other / "train.jsonl").write_text(
        "\n".join((regen / "train.jsonl").read_text().splitlines()[-2:]) + "\n"
    )
    seqs = load_sequences(other, "train", 512, target.fingerprint)
    saved = weights(first)["d2t"]
    assert not torch.equal(make_task("eagle", target, seqs, tmp_path, cfg(tmp_path), kw).net.d2t, saved)
    jobs = []
    monkeypatch.setattr(run_mod, "train_many", lambda j, *a, **k: jobs.extend(j) or [{}])
    run_training(
        "eagle", target, other, tmp_path / "warm", cfg(tmp_path / "warm"), kw, progress=False, init_from=first
    )
    task = jobs[0][0]
    assert torch.equal(task.net.d2t.cpu(), saved)
    head_rows = task.module._frozen[1]  # the target head rows the labels are computed with
    torch.testing.assert_close(head_rows, target.model.lm_head_weight()[saved].float())
    # ... and so must a resume of that warm-started run (it once picked the vocabulary again)
    monkeypatch.undo()
    warm = tmp_path / "warm2"
    run_training("eagle", target, other, warm, cfg(warm, stop_at=1), kw, progress=False, init_from=first)
    jobs.clear()
    monkeypatch.setattr(run_mod, "train_many", lambda j, *a, **k: jobs.extend(j) or [{}])
    run_training("eagle", target, other, warm, cfg(warm), kw, progress=False, init_from=first)
    task = jobs[0][0]
    torch.testing.assert_close(task.module._frozen[1], target.model.lm_head_weight()[saved].float())


def test_offline_vs_served_scores_a_run_on_its_own_vocabulary(data, tmp_path, monkeypatch):
    """--offline-vs-served rebuilds the task on other data: its labels must use the run's draft
    vocabulary, as the run's head does (else offline accuracy reads far below served)."""
    import specdecode.training.run as run_mod

    target, regen = data
    first = tmp_path / "first"
    kw = {"draft_vocab_size": 32, "ttt_steps": 2}
    run_training("eagle", target, regen, first, cfg(first), kw, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "meta.json").write_text((regen / "meta.json").read_text())
    lines = (regen / "train.jsonl").read_text().splitlines()[-2:]
    for split in ("train", "heldout"):
        (other / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    seqs = load_sequences(other, "train", 512, target.fingerprint)
    saved = weights(first)["d2t"]
    assert not torch.equal(make_task("eagle", target, seqs, tmp_path, cfg(tmp_path), kw).net.d2t, saved)
    tasks = []
    monkeypatch.setattr(run_mod, "compare", lambda task, *a, **k: tasks.append(task) or {})
    monkeypatch.setattr(run_mod, "_eval_prompts", lambda *a, **k: [[1, 2, 3]])
    run_mod.run_comparison("eagle", target, other, first, cfg(first), kw)
    task = tasks[0]
    assert torch.equal(task.net.d2t.cpu(), saved)
    torch.testing.assert_close(task.module._frozen[1], target.model.lm_head_weight()[saved].float())


def test_training_data_from_several_regen_directories(data, tmp_path):
    """`--data A,B`: the sequences of A then B, each directory checked against the target."""
    import json

    from specdecode.errors import SpecDecodeError

    target, regen = data
    other = tmp_path / "other"
    other.mkdir()
    (other / "meta.json").write_text((regen / "meta.json").read_text())
    lines = (regen / "train.jsonl").read_text().splitlines()
    (other / "train.jsonl").write_text("\n".join(lines[:3]) + "\n")
    one = load_sequences(regen, "train", 512, target.fingerprint)
    both = load_sequences(f"{regen},{other}", "train", 512, target.fingerprint)
    listed = load_sequences([str(regen), str(other)], "train", 512, target.fingerprint)
    assert len(both) == len(listed) == len(one) + 3
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(listed, both, strict=True))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(both[len(one) :], one[:3], strict=True))
    meta = json.loads((regen / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "target_fingerprint": "another"}))
    with pytest.raises(SpecDecodeError, match="not by this target"):
        load_sequences(f"{regen},{other}", "train", 512, target.fingerprint)
    with pytest.raises(SpecDecodeError, match="no regenerated data directory"):
        load_sequences(" , ", "train", 512, target.fingerprint)


def test_dspark_can_train_its_confidence_head_alone(data, tmp_path):
    """`--train-only confidence` from a trained DSpark: the confidence head's weights move, the STS
    temperatures of the old head go back to 1 (calibrate the new one), every other tensor stays
    bit for bit what it started from, and the card says what was trained. Refused: other values,
    no --init-from, a resume that would train other weights."""
    from safetensors.torch import save_file

    target, regen = data
    kw = {"draft_vocab_size": 128, "num_layers": 1, "block_size": 4, "num_anchors": 4}
    first, second = tmp_path / "first", tmp_path / "second"
    run_training("dspark", target, regen, first, cfg(first, steps=2), kw, progress=False)
    calibrated = weights(first) | {"sts_temperature": torch.full((4,), 2.0, dtype=torch.bfloat16)}
    save_file(calibrated, str(first / "model.safetensors"))  # as `specdecode calibrate` leaves it
    only = {**kw, "train_only": "confidence"}
    run_training("dspark", target, regen, second, cfg(second, steps=3), only, progress=False, init_from=first)
    before, after = weights(first), weights(second)
    moved = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert moved == ["conf.bias", "conf.weight", "sts_temperature"]
    assert torch.equal(after["sts_temperature"].float(), torch.ones(4))
    assert json.loads((second / "config.json").read_text())["training"]["train_only"] == "confidence"
    seqs = load_sequences(regen, "train", 512, target.fingerprint)
    with pytest.raises(SpecDecodeError, match="--train-only"):
        make_task("dspark", target, seqs, tmp_path, cfg(tmp_path), {**kw, "train_only": "markov"})
    with pytest.raises(SpecDecodeError, match="--init-from"):
        run_training("dspark", target, regen, tmp_path / "x", cfg(tmp_path / "x"), only, progress=False)
    stopped = tmp_path / "stopped"  # a run stopped after its first step, resumed without the option
    run_training(
        "dspark", target, regen, stopped, cfg(stopped, stop_at=1), only, progress=False, init_from=first
    )
    with pytest.raises(SpecDecodeError, match="resume with the options"):
        run_training("dspark", target, regen, stopped, cfg(stopped), kw, progress=False)
