"""The `megatron-rl` subcommands, one module each: `add_parser(subparsers)` registers the command and its flags,
and the function it sets as `run` does the work and returns a report (a dict) or None.

A command module imports only the standard library and light project modules (config, layout arithmetic,
model families) at its top; the implementation (torch, Megatron, Ray, vLLM) is imported inside its run
function, so that `megatron-rl --help` and a typo in a flag answer at once.
"""
