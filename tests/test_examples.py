"""The examples run: a few steps of each with tiny sizes, so that they cannot rot."""
import importlib.util
import math
import os
from types import SimpleNamespace

import pytest
import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dp_gpt2_pydoc_trains_a_few_steps(capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("opacus")
    example = load_example("dp_gpt2_pydoc")
    reports = example.main([
        "--epochs", "2", "--steps", "4", "--batch-size", "32", "--context", "16",
        "--n-embd", "16", "--n-layer", "1", "--n-head", "2", "--lr", "1e-2",
        "--sample-length", "12"])
    assert [r["epoch"] for r in reports] == [0, 1, 2]
    assert math.isnan(reports[0]["train_loss"]) and reports[0]["epsilon"] == 0
    assert all(math.isfinite(r["train_loss"]) for r in reports[1:])
    assert 0 < reports[1]["epsilon"] < reports[2]["epsilon"]
    assert reports[2]["held_out_loss"] < reports[0]["held_out_loss"]
    for r in reports:
        assert r["sample"].startswith(example.PROMPT)
        assert len(r["sample"]) == len(example.PROMPT) + 12
    printed = capsys.readouterr().out
    assert printed.count("held-out loss") == 3 and "epsilon" in printed


def test_dp_gpt2_pydoc_text_and_vocabulary():
    pytest.importorskip("transformers")
    example = load_example("dp_gpt2_pydoc")
    text = 'The "if" statement\n\N{EM DASH}'
    assert example.decode(example.encode(text)) == text[:-1] + example.UNKNOWN
    kept = example.prose({"b": "one\n\ntwo\n\n    code", "a": "two\n\nthree", "c": "three"})
    assert kept == {"a": "two\n\nthree", "b": "one"}
    train, held_out = example.load(context=16)
    assert train.shape[1] == held_out.shape[1] == 16
    assert 0.03 < len(held_out) / (len(train) + len(held_out)) < 0.2


def test_dp_gpt2_pydoc_generates_from_the_trained_positions_only():
    """A window of ``context`` characters trains the outputs of its first ``context - 1``
    positions only: generation feeds at most ``context - 1`` characters."""
    pytest.importorskip("transformers")
    example = load_example("dp_gpt2_pydoc")
    lengths = []

    class Recorder(torch.nn.Module):
        def forward(self, input_ids):
            lengths.append(input_ids.shape[1])
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, len(example.ALPHABET) + 1))

    sample = example.generate(Recorder(), "ab", length=6, context=4, top_k=3, seed=0)
    assert len(sample) == 8 and sample.startswith("ab")
    assert lengths == [2, 3, 3, 3, 3, 3]


def test_digits_grad_norms_ranks_flipped_labels_first(capsys):
    pytest.importorskip("sklearn")
    example = load_example("digits_grad_norms")
    result = example.main(["--epochs", "2", "--threads", "1"])
    assert result["precision_at_k"] > 0.3  # a random ranking: 0.1
    assert 0.5 < result["test_accuracy"] <= 1
    assert "precision" in capsys.readouterr().out


def test_kfac_digits_compares_per_epoch_and_per_second(tmp_path, monkeypatch, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    example = load_example("kfac_digits")
    monkeypatch.setattr(example, "GRIDS", {kind: lrs[1:3] for kind, lrs in example.GRIDS.items()})
    out = tmp_path / "curves.png"
    curves = example.main(["--epochs", "2", "--tune-epochs", "1", "--batch-size", "256",
                           "--threads", "1", "--out", str(out)])
    assert [name.split(" (")[0] for name in curves] == ["SGD", "Adam", "SGD + KFAC"]
    for curve in curves.values():
        assert len(curve["train loss"]) == len(curve["seconds"]) == 2
        assert curve["train loss"][1] < curve["train loss"][0] < 2.4
        assert 0 < curve["seconds"][0] < curve["seconds"][1]
    printed = capsys.readouterr().out
    assert "s/epoch" in printed and "SGD + KFAC" in printed
    assert out.stat().st_size > 1000


def test_dp_digits_augmentation_spends_the_same_epsilon(monkeypatch, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("opacus")
    monkeypatch.syspath_prepend(EXAMPLES)  # it imports the digits example's model and data
    example = load_example("dp_digits_augmentation")
    results = example.main(["--epochs", "2", "--multiplicities", "1", "3", "--batch-size",
                            "256", "--threads", str(torch.get_num_threads())])
    assert sorted(results) == [1, 3] and all(len(r) == 2 for r in results.values())
    assert [e for _, e in results[1]] == [e for _, e in results[3]]  # groups, not rows, count
    assert all(acc > 0.2 for r in results.values() for acc, _ in r)  # chance is 0.1
    assert "acc K=3" in capsys.readouterr().out


def test_random_shifts_move_each_image_by_at_most_one_pixel(monkeypatch):
    pytest.importorskip("sklearn")
    monkeypatch.syspath_prepend(EXAMPLES)
    example = load_example("dp_digits_augmentation")
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5) + 1
    shifted = example.random_shifts(x, torch.Generator().manual_seed(0))
    for image, moved in zip(x, shifted):
        padded = torch.nn.functional.pad(image, (1, 1, 1, 1))
        assert any(torch.equal(moved, padded[:, i:i + 4, j:j + 5])
                   for i in range(3) for j in range(3))
