"""Run a pytest selection N times in a row in one process (fresh random problems each run: the tests
draw new weights and routing on every call), stopping at the first failure.

  python3 benchmarks/repeat_tests.py N "pytest -k expression" [test file]
"""
from __future__ import annotations

import sys

import pytest


def main():
    n, expr = int(sys.argv[1]), sys.argv[2]
    path = sys.argv[3] if len(sys.argv) > 3 else "tests/test_triton_moe.py"
    done = 0
    for i in range(n):
        rc = pytest.main([path, "-m", "gpu", "-q", "-p", "no:cacheprovider", "-k", expr])
        print(f"run {i + 1}: pytest exit code {int(rc)}", flush=True)
        if rc != 0:
            break
        done = i + 1
    print(f"race tests: {done} of {n} runs in a row passed", flush=True)
    sys.exit(0 if done == n else 1)


if __name__ == "__main__":
    main()
