"""Run a script of kernel cases under Triton's CPU interpreter in a child process (the interpreter is chosen
when the kernels are imported, so it cannot be switched on inside the test process); its JSON lines back."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_interpreter(script: str, timeout: int = 900) -> list:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    path = Path(__file__).with_name(script)
    proc = subprocess.run(
        [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
