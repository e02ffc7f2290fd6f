"""The GPU acceptance suite (`make gpu-check`, docs/gpu.md): a script run on a GPU machine with its own
Python, not a pytest tier (no file here matches pytest's `test_*.py`)."""
