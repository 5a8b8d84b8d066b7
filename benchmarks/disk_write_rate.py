"""How fast this machine's disk takes writes once the page cache stops absorbing them: the floor under any
conversion whose output is larger than the dirty-page limit (the real checkpoint's ~430 GB of shards).

N threads pwrite --gb of bytes into 512 MB files in a fresh folder (pieces of 16 MiB, each piece's writeback
started by porter.engine.writer.Writeback, the background thread a conversion uses), then fsync every file. Prints the rate per --window seconds as the writes land in the page cache (the first windows run at
memory speed until the kernel's dirty limit throttles the writers; after that the rate is the disk's), the
rate over the second half, and the whole rate to durable. The files are deleted at the end.

For a conversion the rate that matters is source bytes per second: output bytes are ~0.54 of the source for
MiniMax-M3's release (bf16 experts -> MXFP8), so a disk that takes W GB/s durable caps a conversion that
writes to it at about W / 0.54 GB/s of source, whatever the CPU or GPU does (--output-ratio).

    python benchmarks/disk_write_rate.py --dir DIR [--gb 32] [--threads 8] [--window 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PIECE = 16 << 20
FILE_BYTES = 512 << 20


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(ROOT / "benchmarks"), help="a folder on the disk to measure")
    ap.add_argument("--gb", type=float, default=32.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--output-ratio", type=float, default=0.54, help="output bytes per source byte of the "
                    "conversion the cap is stated for")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from porter.engine.sysio import start_writeback
    from porter.engine.writer import Writeback
    files = max(1, int(args.gb * 1e9) // FILE_BYTES)
    data = memoryview(os.urandom(PIECE))  # incompressible, written again and again
    written = [0]
    lock = threading.Lock()
    flusher = Writeback()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        fds = [os.open(Path(tmp) / f"f{i:04d}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for i in range(files)]
        dups = [flusher.open(fd) for fd in fds]  # Writeback's own descriptors (None past its MAX_FDS: inline)
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(files):
            for off in range(0, FILE_BYTES, PIECE):
                jobs.put((i, off))

        def worker():
            while True:
                try:
                    i, off = jobs.get_nowait()
                except queue.Empty:
                    return
                n = os.pwrite(fds[i], data, off)
                if dups[i] is None:
                    start_writeback(fds[i], off, n)
                else:
                    flusher.submit(dups[i], off, n)
                with lock:
                    written[0] += n

        threads = [threading.Thread(target=worker) for _ in range(args.threads)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        windows, last_t, last_b = [], t0, 0
        while any(t.is_alive() for t in threads):
            time.sleep(args.window / 20)
            now = time.perf_counter()
            if now - last_t >= args.window:
                with lock:
                    b = written[0]
                windows.append({"t": round(now - t0, 2), "gb_per_s": (b - last_b) / (now - last_t) / 1e9})
                last_t, last_b = now, b
        for t in threads:
            t.join()
        t_written = time.perf_counter() - t0
        flusher.stop()  # every range asked for, its descriptors closed
        for fd in fds:
            os.fsync(fd)
        t_durable = time.perf_counter() - t0
        for fd in fds:
            os.close(fd)
    total = written[0]
    half = [w["gb_per_s"] for w in windows if w["t"] > t_written / 2]
    second_half = sum(half) / len(half) if half else None
    result = {"gb": total / 1e9, "threads": args.threads, "seconds_written": t_written, "seconds_durable": t_durable,
              "gb_per_s_durable": total / t_durable / 1e9, "gb_per_s_second_half": second_half,
              "windows": windows, "output_ratio": args.output_ratio,
              "source_gb_per_s_cap": (second_half or total / t_durable / 1e9) / args.output_ratio}
    print(f"{total / 1e9:.1f} GB, {args.threads} threads: written in {t_written:.1f} s, durable in {t_durable:.1f} s "
          f"({result['gb_per_s_durable']:.2f} GB/s); second half of the writes {second_half or float('nan'):.2f} GB/s "
          f"-> a conversion writing {args.output_ratio} bytes per source byte here is capped at "
          f"{result['source_gb_per_s_cap']:.2f} GB/s of source")
    print("per window (s, GB/s): " + ", ".join(f"{w['t']:.0f}: {w['gb_per_s']:.2f}" for w in windows))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
