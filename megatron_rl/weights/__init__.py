"""The weight path: naming, sharding plans, gathering full HF tensors, buckets and transports."""
