"""The Megatron-Core side: model and optimizer build, logprob forward, train step, distributed checkpoints."""
