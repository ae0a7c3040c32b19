"""The message format between stages (``agents/worker/wire.py``), without processes: what is sent
is what the receiver rebuilds, in as few sends as the format allows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from felactl.agents.worker import wire


def _round_trip(value, encode=wire.encode, decode=wire.decode):
    sent = encode(value)
    queue = list(sent)

    def recv(buffer: torch.Tensor) -> None:
        part = queue.pop(0)
        assert part.shape == buffer.shape and part.dtype == buffer.dtype
        buffer.copy_(part)

    got = decode(recv, torch.device("cpu"))
    assert not queue, "the receiver took every part that was sent"
    return got, len(sent)


def test_a_tensor_travels_in_two_sends_its_header_and_itself():
    """The header's size once went ahead of it: three sends a message, each a turn of the sender's
    I/O thread on a busy core (a chain of two CPU slots ran 1.3x without it)."""
    x = torch.randn(3, 4)
    got, sends = _round_trip(x)
    assert torch.equal(got, x) and sends == 2


def test_a_split_models_values_keep_their_kinds_dtypes_and_numbers():
    values = (torch.randn(2, 5, 8), torch.arange(5), 7, torch.ones(2, 5, dtype=torch.bool))
    got, sends = _round_trip(values)
    assert isinstance(got, tuple) and len(got) == 4 and got[2] == 7
    assert all(torch.equal(a, b) for a, b in zip((got[0], got[1], got[3]), (values[0], values[1], values[3])))
    assert got[1].dtype == torch.int64 and got[3].dtype == torch.bool and sends == 1 + 3


@pytest.mark.parametrize("count", [wire.MAX_VALUES, wire.MAX_VALUES + 1, 3 * wire.MAX_VALUES])
def test_more_values_than_the_fixed_header_holds_send_their_header_after_it(count):
    values = tuple(torch.full((2,), float(i)) if i % 2 else i for i in range(count))
    got, sends = _round_trip(values)
    assert [g if isinstance(g, int) else int(g[0]) for g in got] == list(range(count))
    tensors = count // 2
    assert sends == 1 + tensors + (count > wire.MAX_VALUES)


def test_the_benchmarks_baseline_is_the_framing_before_the_fixed_header():
    """benchmarks/bench_wire.py measures the wire against the framing it replaced: that framing
    must carry the same values in the one send more that it took."""
    spec = importlib.util.spec_from_file_location(
        "bench_wire", Path(__file__).parents[1] / "benchmarks" / "bench_wire.py"
    )
    bench_wire = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_wire)
    encode, decode = bench_wire.size_ahead(wire)
    x = torch.randn(3, 4)
    got, sends = _round_trip(x, encode, decode)
    assert torch.equal(got, x) and sends == 3
    values = (torch.randn(2, 5, 8), torch.randn(5, 2), torch.randn(5, 2), 5)
    got, sends = _round_trip(values, encode, decode)
    assert got[3] == 5 and all(torch.equal(a, b) for a, b in zip(got[:3], values[:3])) and sends == 2 + 3
