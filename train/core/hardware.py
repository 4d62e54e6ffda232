"""What the machine can do fast: which CPUs have bf16 units, and `trainer.precision=auto`.

A CPU's bf16 matmuls pay only where it has bf16 units (AVX512-BF16 or AMX); elsewhere oneDNN
emulates them and bf16 autocast runs several times slower than float32 (measured:
docs/train.md). `torch.ops.mkldnn._is_mkldnn_bf16_supported()` is true on any AVX-512 CPU, so
it cannot tell the two apart; the CPU's own feature flags can.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

AUTO = "auto"


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 matmul units: AVX512-BF16 or AMX-BF16."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        c = caps()
        return bool(c.get("avx512_bf16") or c.get("amx_bf16"))
    cpuinfo = Path("/proc/cpuinfo")  # older torch: the kernel's flags (Linux)
    if cpuinfo.is_file():
        flags = set(cpuinfo.read_text().split())
        return bool({"avx512_bf16", "amx_bf16"} & flags)
    return False


def resolve_precision(precision: object, accelerator: object) -> tuple[str, str]:
    """`trainer.precision` with `auto` resolved for `accelerator`: (precision, why).

    auto is bf16-mixed where bf16 is fast (a GPU that supports it, a CPU with bf16 units) and
    32-true elsewhere. Any other value is returned as it is."""
    if str(precision) != AUTO:
        return str(precision), "as configured"
    acc = str(accelerator or AUTO)
    gpu = acc in ("gpu", "cuda") or (acc == AUTO and torch.cuda.is_available())
    if gpu:
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16-mixed", "GPU with bf16 support"
        return "32-true", "GPU without bf16 support"
    if cpu_has_bf16():
        return "bf16-mixed", "CPU with bf16 units (AVX512-BF16 / AMX)"
    return "32-true", "CPU without bf16 units (AVX512-BF16 / AMX): bf16 would be emulated"
