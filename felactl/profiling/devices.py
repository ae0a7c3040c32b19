"""Probing one machine: the node (cores, memory), each worker slot's compute, and the GPU interconnect.

Compute is measured, not looked up: a square matmul timed ``repetitions`` times, median taken, so
a throttled GPU or a busy CPU shows up as the slower device it currently is. A CPU slot is
measured from inside the worker process pinned to its share of the cores, with torch limited to
that many threads, so the number is what that worker will get.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import statistics
import subprocess
import time

from felactl.machine import cpu_quota_cores
from felactl.spec import cpu_slot_model

GB = 1e9


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def cpu_slot_model_name() -> str:
    """This process's CPU slot as a hardware model: the CPU's name, with the cgroup quota that holds
    it below its cores where one does (:func:`felactl.spec.cpu_slot_model`)."""
    return cpu_slot_model(cpu_model_name(), cpu_quota_cores())


MIN_BLOCK_S = 0.1
"""How long each timed block of matmuls lasts at least. A CPU share capped by a cgroup (a
container's CPU limit, a testbed node) runs at full speed for its quota, then waits out the rest
of the CFS period (10 ms in a testbed, 100 ms by default): a single product fits inside the quota
and sees the full core, a block spanning several periods sees the share."""


def matmul_tflops(size: int, repetitions: int, device=None, dtype=None, *, min_block_s: float = MIN_BLOCK_S) -> float:
    """Dense matmul throughput (2·n³ flops per product) on ``device``, TFLOP/s: the median over
    ``repetitions`` blocks, each of as many products as last ``min_block_s`` together (one, if a
    product takes longer)."""
    import torch

    device = torch.device(device or "cpu")
    dtype = dtype or torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.matmul(a, b)  # warm-up: allocations, kernel selection
    sync()
    rates = []
    for _ in range(repetitions):
        start, products = time.perf_counter(), 0
        while True:
            torch.matmul(a, b)
            sync()
            products += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_block_s:
                break
        rates.append(products / elapsed)
    return 2.0 * size**3 * statistics.median(rates) / 1e12


def pin_to_cores(cores, *, strict: bool = False) -> None:
    """Run this process on ``cores`` (where the OS allows it) with as many torch threads, as a
    worker of that CPU slot runs. ``strict``: a core this machine lacks raises OSError."""
    import torch

    if cores:
        try:
            os.sched_setaffinity(0, list(cores))
        except AttributeError:
            pass
        except OSError:
            if strict:
                raise
    torch.set_num_threads(max(1, len(cores)) if cores else 1)


def measure_cpu_slot(cores: list[int], *, matmul_size: int, repetitions: int, memory_gb: float) -> dict:
    """Pin this process to ``cores``, then measure its matmul throughput."""
    pin_to_cores(cores)
    return {
        "kind": "cpu",
        "model": cpu_slot_model_name(),
        "cpu_cores": list(cores),
        "memory_gb": memory_gb,
        "tflops": matmul_tflops(matmul_size, repetitions),
    }


def measure_cuda_slot(local_rank: int, *, matmul_size: int, repetitions: int) -> dict:
    """fp32 (TF32 off, so it is fp32) and bf16 matmul throughput of GPU ``local_rank``."""
    import torch

    torch.cuda.set_device(local_rank)
    props = torch.cuda.get_device_properties(local_rank)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        fp32 = matmul_tflops(matmul_size, repetitions, f"cuda:{local_rank}", torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    bf16 = (
        matmul_tflops(matmul_size, repetitions, f"cuda:{local_rank}", torch.bfloat16)
        if torch.cuda.is_bf16_supported()
        else None
    )
    return {
        "kind": "cuda",
        "model": props.name,
        "memory_gb": round(props.total_memory / GB, 3),
        "tflops": fp32,
        "bf16_tflops": bf16,
    }


# --- the GPU interconnect ----------------------------------------------------------------------
def gpu_interconnect(num_gpus: int) -> dict[tuple[int, int], dict]:
    """(i, j) -> {"type": "nvlink"|"pcie", "num_links": n} for every pair of local GPUs.

    NVML (pynvml) when importable, else ``nvidia-smi topo -m``, else everything is PCIe.
    """
    for reader in (_nvml_nvlinks, _smi_nvlinks):
        counts = reader(num_gpus)
        if counts is not None:
            break
    else:
        counts = {}
    return {
        (i, j): (
            {"type": "nvlink", "num_links": counts[(i, j)]}
            if counts.get((i, j), 0) > 0
            else {"type": "pcie", "num_links": 1}
        )
        for i in range(num_gpus)
        for j in range(num_gpus)
        if i != j
    }


def _nvml_nvlinks(num_gpus: int) -> dict[tuple[int, int], int] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml raises its own NVMLError family; no driver means no NVML answer
        return None
    try:
        handles = [_nvml_handle(pynvml, i) for i in range(num_gpus)]
        bus_ids = [_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        counts: dict[tuple[int, int], int] = {}
        for i, handle in enumerate(handles):
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if not pynvml.nvmlDeviceGetNvLinkState(handle, link):
                        continue
                    remote = _bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                except Exception:  # link index not present on this GPU
                    continue
                if remote in bus_ids and bus_ids.index(remote) != i:
                    key = (i, bus_ids.index(remote))
                    counts[key] = counts.get(key, 0) + 1
        return counts
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _nvml_handle(pynvml, cuda_ordinal: int):
    """NVML numbers GPUs in PCI order, CUDA by speed and CUDA_VISIBLE_DEVICES: match them by PCI address."""
    import torch

    props = torch.cuda.get_device_properties(cuda_ordinal)
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        address = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(address.encode())
    return pynvml.nvmlDeviceGetHandleByIndex(cuda_ordinal)


def _bus_id(raw) -> tuple[int, ...]:
    """``00000000:3B:00.0`` / ``0000:3b:00.0`` -> (domain, bus, device): NVML pads domains differently."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return tuple(int(part, 16) for part in text.replace(".", ":").split(":")[:3])


def _smi_nvlinks(num_gpus: int) -> dict[tuple[int, int], int] | None:
    """nvidia-smi's GPU indices are PCI order: right for profiling workers (CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_nvidia_smi_topo(text, num_gpus)


def parse_nvidia_smi_topo(text: str, num_gpus: int) -> dict[tuple[int, int], int] | None:
    """NVLink counts from ``nvidia-smi topo -m`` (``NV4`` -> 4 links; PIX/PXB/PHB/NODE/SYS -> 0)."""
    clean = re.sub(r"\x1b\[[0-9;]*m", "", text)
    rows = {}
    header: list[str] | None = None
    for line in clean.splitlines():
        cells = line.split()
        if header is None and cells and cells[0].startswith("GPU"):
            header = cells
            continue
        if header is not None and cells and re.fullmatch(r"GPU\d+", cells[0]):
            rows[int(cells[0][3:])] = cells[1 : 1 + len(header)]
    if header is None or not rows:
        return None
    columns = [int(h[3:]) for h in header if re.fullmatch(r"GPU\d+", h)]
    counts = {}
    for i, cells in rows.items():
        for col, cell in zip(columns, cells):
            match = re.fullmatch(r"NV(\d+)", cell)
            if match and i != col and i < num_gpus and col < num_gpus:
                counts[(i, col)] = int(match.group(1))
    return counts


def peer_copy_gbps(num_gpus: int, message_bytes: int, repetitions: int) -> dict[tuple[int, int], float]:
    """Median device-to-device copy bandwidth for every ordered pair of local GPUs, GB/s."""
    import torch

    out = {}
    numel = max(1, message_bytes // 4)
    for i in range(num_gpus):
        src = torch.ones(numel, device=f"cuda:{i}")
        for j in range(num_gpus):
            if i == j:
                continue
            dst = torch.empty(numel, device=f"cuda:{j}")
            dst.copy_(src)
            torch.cuda.synchronize(i)
            torch.cuda.synchronize(j)
            times_s = []
            for _ in range(repetitions):
                start = time.perf_counter()
                dst.copy_(src)
                torch.cuda.synchronize(i)
                torch.cuda.synchronize(j)
                times_s.append(time.perf_counter() - start)
            out[(i, j)] = numel * 4 / max(statistics.median(times_s), 1e-9) / GB
    return out
