"""Generation side: vLLM engine actors, the engine pool, the rollout buffer, tasks and rewards."""
