"""What the CLI runs: convert, verify and inspect (siblings: none imports another)."""
