"""megatron-rl: asynchronous RL post-training of Mixture-of-Experts models with Megatron-Core and vLLM."""

__version__ = "0.1.0"
