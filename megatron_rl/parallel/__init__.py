"""Process-group set-up, rank layout arithmetic, and the Megatron-Core CPU patches."""
