"""The engine suite needs vLLM and sglang installed (tests/engines/run.sh makes that venv). The project's
main test command does not collect it; run.sh sets PORTER_ENGINES=1, and then a missing engine is an error,
never a skip."""

import os

if not os.environ.get("PORTER_ENGINES"):
    collect_ignore_glob = ["*"]
