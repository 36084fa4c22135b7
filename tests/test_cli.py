"""CLI contract: JSON output fields, streaming, and clear errors (exit 2, no traceback)."""

import json

import pytest

from specdecode.cli import main

JSON_FIELDS = {
    "id",
    "text",
    "token_ids",
    "num_new_tokens",
    "num_steps",
    "tau",
    "accepted_per_position",
    "decode_time_s",
    "tokens_per_s",
}


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_from_prompts_file(capsys, tmp_path, tiny_llama_dir):
    p = tmp_path / "p.jsonl"
    p.write_text(
        json.dumps({"id": "x", "prompt": "the cat"})
        + "\n"
        + json.dumps({"id": "y", "messages": [{"role": "user", "content": "hi"}], "seed": 5})
        + "\n"
    )
    code, out, err = _run(
        capsys,
        "generate",
        "--target",
        str(tiny_llama_dir),
        "--method",
        "ngram",
        "--prompts",
        str(p),
        "--max-new-tokens",
        "8",
        "--dtype",
        "fp32",
        "--json",
    )
    assert code == 0, err
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["id"] for o in objs] == ["x", "y"]
    for o in objs:
        assert JSON_FIELDS <= set(o)
        assert 1 <= o["num_new_tokens"] <= 8 and o["tau"] >= 1.0


def test_generate_streams_text_and_summary(capsys, tiny_llama_dir):
    code, out, err = _run(
        capsys,
        "generate",
        "--target",
        str(tiny_llama_dir),
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        "3",
    )
    assert code == 0, err
    assert out.endswith("\n") and "tokens/s" in err and "tau" in err


@pytest.mark.parametrize(
    "args, match",
    [
        (["--temperature", "-1"], "temperature must be"),
        (["--top-p", "0"], "top_p must be in"),
        (["--top-p", "1.5"], "top_p must be in"),
        (["--top-k", "-2"], "top_k must be"),
        (["--num-draft-tokens", "-1", "--method", "ngram"], "must be >= 0"),
        (["--method", "nope"], "unknown method 'nope'; choose one of: ar, ngram, ngram-tree, ngram-table,"),
        (["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
        (["--method", "draft"], "needs a drafter model"),
    ],
)
def test_bad_parameters(capsys, tiny_llama_dir, args, match):
    code, _, err = _run(capsys, "generate", "--target", str(tiny_llama_dir), "--prompt", "hi", *args)
    assert code == 2
    assert match in err and "Traceback" not in err


def test_bad_model_path_lists_aliases(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "--target", str(tmp_path / "missing"), "--prompt", "hi")
    assert code == 2 and "smollm2-135m" in err


def test_empty_prompt_and_malformed_file(capsys, tmp_path, tiny_llama_dir):
    code, _, err = _run(capsys, "generate", "--target", str(tiny_llama_dir), "--prompt", "  ")
    assert code == 2 and "non-empty" in err
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\n{"prompt": \n')
    code, _, err = _run(capsys, "generate", "--target", str(tiny_llama_dir), "--prompts", str(p))
    assert code == 2 and "bad.jsonl:2" in err


def test_prompt_longer_than_context(capsys, tiny_llama_dir):
    code, _, err = _run(capsys, "generate", "--target", str(tiny_llama_dir), "--prompt", "word " * 5000)
    assert code == 2 and "context" in err


def test_drafter_with_other_tokenizer_is_refused(capsys, tiny_llama_dir, other_tokenizer_model_dir):
    code, _, err = _run(
        capsys,
        "generate",
        "--target",
        str(tiny_llama_dir),
        "--method",
        "draft",
        "--drafter",
        str(other_tokenizer_model_dir),
        "--prompt",
        "hi",
    )
    assert code == 2 and "different tokenizer" in err


def test_models_list(capsys):
    code, out, _ = _run(capsys, "models", "list")
    assert code == 0 and "smollm2-135m" in out and "qwen2.5-coder-1.5b" in out and "mt-bench" in out


def test_data_build_writes_a_disjoint_prompt_set(capsys, tmp_path):
    code, out, err = _run(capsys, "data", "build", "--out", str(tmp_path / "d"), "--num-prompts", "200")
    assert code == 0, err
    lines = (tmp_path / "d" / "train.jsonl").read_text().splitlines()
    held = (tmp_path / "d" / "heldout.jsonl").read_text().splitlines()
    assert len(lines) + len(held) == 200 and "train" in out
    code, _, err = _run(capsys, "data", "build", "--out", str(tmp_path / "d"), "--num-prompts", "300")
    assert code == 2 and "overwrite" in err
    args = ("data", "build", "--out", str(tmp_path / "chat"), "--num-prompts", "50", "--sources", "chat")
    code, _, err = _run(capsys, *args)
    assert code == 0, err
    chat = (tmp_path / "chat" / "train.jsonl").read_text() + (tmp_path / "chat" / "heldout.jsonl").read_text()
    assert [json.loads(line)["source"] for line in chat.splitlines()] == ["chat"] * 50
    code, _, err = _run(capsys, "data", "build", "--out", str(tmp_path / "e"), "--sources", "novels")
    assert code == 2 and "sources must be distinct names" in err


def test_demo_compares_ar_with_the_method_asked_for(capsys, tiny_llama_dir):
    code, out, _ = _run(
        capsys,
        "demo",
        "--target",
        str(tiny_llama_dir),
        "--method",
        "ngram",
        "--max-new-tokens",
        "6",
        "--dtype",
        "fp32",
    )
    assert code in (0, None)
    assert "Overall: ngram tau" in out and "identical greedy output on" in out
    code, _, err = _run(capsys, "demo", "--target", str(tiny_llama_dir), "--method", "ngram-table")
    assert code == 2 and "ngram-table" in err  # no table ships for this model: says what to do


@pytest.mark.parametrize("method", ["eagle", "dspark,eagle"])
def test_train_only_is_refused_where_no_method_takes_it(capsys, tmp_path, tiny_llama_dir, method):
    """--train-only retrains a part only DSpark has: another method, or several side by side, would
    silently train everything."""
    code, _, err = _run(
        capsys, "train", method, "--target", str(tiny_llama_dir), "--data", str(tmp_path),
        "--out", str(tmp_path / "out"), "--train-only", "confidence",
    )  # fmt: skip
    assert code == 2 and "--train-only applies to dspark trained alone" in err and "Traceback" not in err
