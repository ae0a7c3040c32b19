"""A torchrun-style training script as a user writes it, knowing nothing of felactl:
``init_process_group("env://")``, DDP on gloo, its own DataLoader with a DistributedSampler.

Rank 0 prints one JSON line at the end: the final loss (averaged over the ranks), the arguments it
got and the restart count it saw. ``--fail-rank R --exit-code C`` makes rank R exit with C before
it joins (``--first-attempt-only``: only while TORCHELASTIC_RESTART_COUNT is 0).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--exit-code", type=int, default=1)
    parser.add_argument("--first-attempt-only", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == args.fail_rank and (restart_count == 0 or not args.first_attempt_only):
        print(f"rank {rank}: failing on purpose with {args.exit_code}", flush=True)
        sys.exit(args.exit_code)

    dist.init_process_group("gloo", init_method="env://")
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 8, generator=generator)
    targets = inputs @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(256, 1, generator=generator)
    dataset = TensorDataset(inputs, targets)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    step, loss = 0, torch.zeros(())
    while step < args.steps:
        sampler.set_epoch(step)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            if step == args.steps:
                break
    final = loss.detach().clone()
    dist.all_reduce(final)
    if rank == 0:
        print(
            json.dumps(
                {
                    "final_loss": final.item() / dist.get_world_size(),
                    "world_size": dist.get_world_size(),
                    "argv": sys.argv[1:],
                    "restart_count": restart_count,
                }
            ),
            flush=True,
        )
    dist.barrier()  # no rank tears its connections down while another still reads them
    dist.destroy_process_group()
    # Under load, gloo's worker threads can still hold work at interpreter finalization and abort
    # the process (SIGABRT, "terminate called without an active exception") under torchrun as
    # under felactl: a torch issue (pytorch/pytorch#179291), not what these tests compare.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
