"""`broker.frame_batch`: the frames of one loop turn reach the child in one write, in order."""

from __future__ import annotations

import asyncio
import sys

from broker.frame_batch import FrameBatch
from broker.liveness import Drops


async def test_frames_of_one_turn_go_in_one_write_in_order() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys; sys.stdout.write(sys.stdin.read())",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None
    writes: list[bytes] = []
    write = proc.stdin.write

    def counted(data: bytes | bytearray | memoryview) -> None:
        writes.append(bytes(data))
        write(data)

    proc.stdin.write = counted  # type: ignore[method-assign]  # count the writes
    drops = Drops()
    batch = FrameBatch(lambda: proc, drops, 1 << 20)
    assert all(batch.send(proc, b"frame %d" % i) for i in range(3))
    assert writes == []  # nothing yet: the turn is not over
    await asyncio.sleep(0)  # one turn of the loop (the batch's own call_soon)
    assert writes == [b"frame 0\nframe 1\nframe 2\n"]
    assert batch.send(proc, b"frame 3")  # the next turn: a write of its own
    await asyncio.sleep(0)
    proc.stdin.close()
    out, _ = await proc.communicate()
    assert out == b"frame 0\nframe 1\nframe 2\nframe 3\n"
    assert len(writes) == 2
    assert drops.total == 0


async def test_frames_for_a_child_that_exited_within_the_turn_are_counted_dropped() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "pass", stdin=asyncio.subprocess.PIPE
    )
    drops = Drops()
    current: list[asyncio.subprocess.Process | None] = [proc]
    batch = FrameBatch(lambda: current[0], drops, 1 << 20)
    assert batch.send(proc, b"a")
    assert batch.send(proc, b"b")
    current[0] = None  # replaced (restarting) before the turn ended
    await asyncio.sleep(0)
    assert drops.total == 2
    assert not batch.send(None, b"c")  # control: no child at all is a drop at once
    assert drops.total == 3
    await proc.wait()
