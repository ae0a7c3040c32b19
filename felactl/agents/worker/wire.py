"""What crosses between workers when one hands another a micro-batch's activations or gradients:
one tensor (an ``nn.Sequential``'s layers), or a tuple of tensors and numbers (a split model's
live values: hidden states, position tables, masks, sizes). A message is a header of a fixed
size that describes every value (kind, dtype, dims or the number), then the tensors; sizes travel
with each message, so micro-batches of any size need no agreement.

Every send is a gloo (or NCCL) operation the receiver waits on, and on busy CPU slots each costs
the sender's I/O thread a turn on its core: the header's own size, once sent ahead of it, made a
one-tensor message three operations, and a chain of two local CPU slots ran 1.25x when it went
into the fixed header (a user's word-level LM at micro-batch 1: 156 -> 195 samples/s, medians of
three runs each). A message of more values than the fixed header holds sends its whole header
after it (one operation more)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

MAX_DIMS = 7
DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
"""What a message may carry: a header names each tensor's dtype by its place here."""
TENSOR, NUMBER = 1, 2
FIELDS = 3 + MAX_DIMS  # per value: kind, dtype, number of dims (or the number), dims
ONE = -1
"""The count of a message that is one tensor, not a tuple."""
MAX_VALUES = 16
"""Values the fixed header describes."""
HEADER_SIZE = 1 + FIELDS * MAX_VALUES
LONG = -2
"""The count in the fixed header of a message of more than :data:`MAX_VALUES` values: the size of
its whole header follows it, and the whole header is sent next."""


def encode(value: Any) -> list[torch.Tensor]:
    """The tensors that carry ``value``, in the order to send them (all on CPU but ``value``'s)."""
    items = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    header = torch.zeros(1 + FIELDS * len(items), dtype=torch.long)
    header[0] = ONE if isinstance(value, torch.Tensor) else len(items)
    tensors = []
    for i, item in enumerate(items):
        row = header[1 + FIELDS * i : 1 + FIELDS * (i + 1)]
        if isinstance(item, torch.Tensor):
            if item.dim() > MAX_DIMS:
                raise ValueError(f"a tensor of {item.dim()} dims crosses a stage boundary; at most {MAX_DIMS}")
            tensors.append(item.detach().contiguous())
            row[0], row[1], row[2] = TENSOR, DTYPES.index(item.dtype), item.dim()
            row[3 : 3 + item.dim()] = torch.tensor(item.shape)
        else:
            row[0], row[2] = NUMBER, int(item)
    fixed = torch.zeros(HEADER_SIZE, dtype=torch.long)
    if header.numel() <= HEADER_SIZE:
        fixed[: header.numel()] = header
        return [fixed, *tensors]
    fixed[0], fixed[1] = LONG, header.numel()
    return [fixed, header, *tensors]


def decode(recv: Callable[[torch.Tensor], None], device: torch.device) -> Any:
    """Receive one message with ``recv(buffer)`` (fills a tensor from the peer) onto ``device``."""
    header = torch.zeros(HEADER_SIZE, dtype=torch.long, device=device)
    recv(header)
    header = header.cpu()
    if int(header[0]) == LONG:
        whole = torch.zeros(int(header[1]), dtype=torch.long, device=device)
        recv(whole)
        header = whole.cpu()
    return read_values(header, recv, device)


def read_values(header: torch.Tensor, recv: Callable[[torch.Tensor], None], device: torch.device) -> Any:
    """The value ``header`` (on the CPU) describes, its tensors received with ``recv``."""
    items = []
    for i in range(max(1, int(header[0]))):
        row = header[1 + FIELDS * i : 1 + FIELDS * (i + 1)].tolist()
        if row[0] == NUMBER:
            items.append(row[2])
            continue
        tensor = torch.empty(tuple(row[3 : 3 + row[2]]), dtype=DTYPES[row[1]], device=device)
        recv(tensor)
        items.append(tensor)
    return items[0] if int(header[0]) == ONE else tuple(items)
