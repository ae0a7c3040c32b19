"""The built-in models and their download-free data: deterministic, addressable, and learnable."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

from felactl import TrainJob
from felactl.errors import InputError
from felactl.models import build, lm_loss
from felactl.models.data import CharCorpus, PrototypeImages, TeacherDataset, python_docs_text

SMALL = {
    "gpt-mini": {"depth": 1, "width": 64, "num_heads": 2, "seq_len": 32},
    "vgg-mini": {"width": 8, "fc_width": 128, "image_size": 16},
    "mlp": {"input_dim": 32, "hidden": 64, "depth": 2},
}


def _train(name: str, steps: int, batch: int, lr: float) -> list[float]:
    torch.manual_seed(0)
    bundle = build(name, SMALL[name], seed=0)
    optimizer = torch.optim.AdamW(bundle.layers.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        inputs, targets = bundle.data.batch(range(step * batch, (step + 1) * batch))
        loss = bundle.loss(bundle.layers(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "name, steps, batch, lr, min_drop",
    [
        ("gpt-mini", 200, 16, 3e-3, 0.8),  # 3.64 -> 2.39 measured
        ("vgg-mini", 200, 32, 1e-3, 1.5),  # 2.30 -> 0.14 measured
        ("mlp", 200, 32, 3e-3, 1.0),  # 2.26 -> 0.74 measured
    ],
)
def test_single_process_training_reduces_the_loss(name, steps, batch, lr, min_drop):
    losses = _train(name, steps, batch, lr)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert first - last > min_drop, f"{name}: mean loss of first 10 steps {first:.3f}, last 10 {last:.3f}"
    # Learning, not only a badly scaled start settling: the end is far below chance level.
    num_classes = len(set(python_docs_text())) if name == "gpt-mini" else 10
    assert last < math.log(num_classes) - min_drop
    assert all(l == l for l in losses)  # no NaN on the way


def _batch(data, indices):
    """A batch of a dataset, as the worker forms it (the job's ``collate_fn``, indices wrapping)."""
    return TrainJob(model=nn.Identity(), dataset=data, loss_fn=lm_loss).batch(indices)


def test_char_corpus_targets_are_inputs_shifted_by_one():
    corpus = CharCorpus(seq_len=24)
    inputs, targets = _batch(corpus, [0, 5, 123_456])
    assert inputs.shape == targets.shape == (3, 24) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert len(corpus.vocab) == len(set(python_docs_text())) and int(inputs.max()) < len(corpus.vocab)
    assert len(python_docs_text()) > 100_000


def test_samples_are_addressed_by_global_index():
    """Any worker can fetch its share of a step: batch(i..j) equals the rows of a bigger batch."""
    for data in (CharCorpus(16), TeacherDataset((8,), 4, num_samples=100), PrototypeImages((3, 8, 8), 5, 100)):
        x_all, y_all = _batch(data, range(10, 20))
        x_part, y_part = _batch(data, [13, 14])
        assert torch.equal(x_part, x_all[3:5]) and torch.equal(y_part, y_all[3:5])
        x_wrap, _ = _batch(data, [len(data) + 13])
        assert torch.equal(x_wrap[0], x_all[3])


def test_synthetic_labels_use_every_class():
    for data in (TeacherDataset((32,), 10), PrototypeImages((3, 16, 16), 10)):
        counts = torch.bincount(data.labels, minlength=10)
        assert counts.min() > 0.03 * len(data) and counts.max() < 0.3 * len(data)


def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (build("mlp", SMALL["mlp"], seed=s).layers for s in (3, 3, 4))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_layers_are_the_children_of_a_sequential():
    bundle = build("gpt-mini", SMALL["gpt-mini"])
    assert isinstance(bundle.layers, nn.Sequential) and len(bundle.layers) == 1 + 1 + 1
    assert bundle.config["vocab_size"] == len(set(python_docs_text()))
    assert len(build("vgg-mini", SMALL["vgg-mini"]).layers) == 9


def user_layers(hidden: int = 8):
    return [nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2)]


def user_not_sequential():
    return nn.Linear(4, 2)


@pytest.mark.parametrize(
    "source, config, words",
    [
        ("resnet-huge", {}, "unknown model 'resnet-huge'"),
        ("gpt-mini", {"colour": "blue"}, "unknown config key 'colour'; it takes depth, width, num_heads, seq_len"),
        ("gpt-mini", {"num_heads": 0}, "num_heads=0: must be an integer >= 1"),
        ("gpt-mini", {"width": 30, "num_heads": 4}, "bad config .* must be divisible by num_heads"),
        ("mlp", {"hidden": 1.5}, "hidden=1.5: must be an integer >= 1"),
        ("mlp", {"depth": "abc"}, "depth='abc': must be an integer >= 1"),
        ("vgg-mini", {"image_size": 4}, "bad config .*image_size must be >= 8"),
        ("no_such_module_xyz:f", {}, "cannot import: .* looks in the current directory, .*, and on PYTHONPATH"),
        ("test_models:missing_function", {}, "cannot import"),
        ("test_models.py:user_layers", {}, r"name the module, not its file: test_models:user_layers"),
        ("test_models:user_not_sequential", {}, "must return a felactl.TrainJob"),
        ("test_models:user_layers", {"hiden": 16}, "unknown config key 'hiden'; it takes hidden"),
    ],
)
def test_bad_model_sources_are_input_errors(source, config, words):
    with pytest.raises(InputError, match=words):
        build(source, config)


def test_user_model_from_a_list_of_layers():
    bundle = build("test_models:user_layers", {"hidden": 16})
    assert isinstance(bundle.layers, nn.Sequential) and bundle.layers[0].out_features == 16
    assert bundle.data is None


def test_a_job_file_named_like_a_standard_module_is_told_so(tmp_path, monkeypatch):
    """A user's wave.py beside them: ``import wave`` finds Python's own wave module first, which
    has no ``job``; the error names the module that was imported and the file it shadowed."""
    (tmp_path / "wave.py").write_text("def job():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match=r"imported .*wave\.py.*not .*tmp.*wave\.py.*rename"):
        build("wave:job", {})
    # an AttributeError raised by the module's own code while it imports is reported as it is
    (tmp_path / "felactl_broken_net.py").write_text("import os\nos.no_such_thing\n")
    try:
        with pytest.raises(InputError, match=r"cannot import: module 'os' has no attribute 'no_such_thing'$"):
            build("felactl_broken_net:job", {})
    finally:
        sys.modules.pop("felactl_broken_net", None)


def test_user_model_found_in_the_working_directory(tmp_path, monkeypatch):
    """``felactl profile --model mynet:build`` run beside mynet.py finds it, as ``python -m`` would."""
    import sys

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "felactl_cwd_net.py").write_text(
        "from torch import nn\ndef make(width=3):\n    return [nn.Linear(2, width), nn.Linear(width, 1)]\n"
    )
    try:
        bundle = build("felactl_cwd_net:make", {"width": 5})
    finally:
        sys.modules.pop("felactl_cwd_net", None)
    assert [m.out_features for m in bundle.layers] == [5, 1]
