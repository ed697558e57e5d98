"""Several station requests at once for one HTTP request (several prompts)."""

from __future__ import annotations

import trio


async def gather(calls: list) -> list:
    """Run the calls at once -> their results in order. The first failure is raised as
    itself, not inside trio's exception group, so a station error keeps its HTTP answer."""
    if len(calls) == 1:
        return [await calls[0]()]
    results = [None] * len(calls)

    async def one(i: int) -> None:
        results[i] = await calls[i]()

    try:
        async with trio.open_nursery() as nursery:
            for i in range(len(calls)):
                nursery.start_soon(one, i)
    except BaseExceptionGroup as group:
        first: BaseException = group
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return results
