"""A `RunControl` behind Ray's call syntax as the launcher awaits it (`TrainerWatch.look`), without Ray."""

from __future__ import annotations

import types

from megatron_rl.rollout.control import RunControl


class AsyncControl:
    """A `RunControl` behind Ray's call syntax as the launcher awaits it; `failing` makes the status call raise."""

    def __init__(self):
        self.control, self.failing = RunControl([("engine-0", 1)]), False

    def __getattr__(self, name: str):
        async def call(*args):
            if self.failing:
                raise ConnectionError("run control unreachable")
            return getattr(self.control, name)(*args)

        return types.SimpleNamespace(remote=call)
