"""Host memory a conversion's GPU path adds to the process: what porter.pipeline.CUDA_CONTEXT_BYTES stands for.

In a fresh process, after `import torch` and porter's conversion modules (what the dry run has loaded when it
measures the process), reads RssAnon, RssFile and VmHWM from /proc/self/status; then makes the CUDA context,
runs porter.format.mxfp8.quantize_with_error on the GPU on a [3072, 6144] bf16 part from 4 threads with a
stream each (the kernels and streams a conversion uses; the part's device memory is not host memory) and
page-locks a small buffer with cudaHostRegister, and reads them again. Prints the increase of each.

    python benchmarks/cuda_context_rss.py [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def status() -> dict:
    from porter.pipeline import memory_status
    return {k: v for k, v in memory_status().items() if k in ("RssAnon", "RssFile", "VmHWM")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from porter import pipeline  # noqa: F401 — loaded as a conversion has them
    from porter.commands import convert  # noqa: F401
    from porter.format import mxfp8  # noqa: F401
    before = status()
    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    after_context = status()
    part = (torch.randn(3072, 6144) * 0.02).bfloat16()
    host = torch.empty(16 << 20, dtype=torch.uint8)
    torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)

    def work():
        stream = torch.cuda.Stream(dev)
        with torch.cuda.stream(stream):
            for _ in range(3):
                mxfp8.quantize_with_error(part.to(dev, non_blocking=True), "rceil", "part")
            stream.synchronize()
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after_work = status()
    result = {"before": before, "after_context": after_context, "after_work": after_work,
              "context_increase": {k: after_context[k] - before[k] for k in before},
              "total_increase": {k: after_work[k] - before[k] for k in before},
              "part_bytes_host": part.numel() * 2 + host.numel(),
              "constant_in_porter": pipeline.CUDA_CONTEXT_BYTES, "gpu": torch.cuda.get_device_name(0),
              "torch": torch.__version__}
    inc = result["total_increase"]
    print(f"{result['gpu']}, torch {torch.__version__}: CUDA context + quantizer kernels on 4 streams add "
          f"RssAnon {inc['RssAnon'] / 1e6:.0f} MB, RssFile {inc['RssFile'] / 1e6:.0f} MB, VmHWM "
          f"{inc['VmHWM'] / 1e6:.0f} MB (context alone: anon {result['context_increase']['RssAnon'] / 1e6:.0f}, "
          f"file {result['context_increase']['RssFile'] / 1e6:.0f} MB); the host part and the 16 MiB registered "
          f"buffer are {result['part_bytes_host'] / 1e6:.0f} MB of that; porter assumes "
          f"{pipeline.CUDA_CONTEXT_BYTES / 1e6:.0f} MB")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
