"""Process-group set-up, rank layout arithmetic, and every patch to Megatron-Core (`patches.py`)."""
