"""`broker.frame_batch`: frames sent together reach the child in one write, in order."""

from __future__ import annotations

import asyncio
import sys

from broker.frame_batch import FrameBatch
from broker.liveness import Drops
from tests.fixtures.waiting import eventually


async def test_frames_sent_together_go_in_one_write_in_order() -> None:
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
    assert writes == []  # nothing yet: the batch is still open
    await eventually(lambda: bool(writes), "the batch's write")
    assert writes == [b"frame 0\nframe 1\nframe 2\n"]
    assert batch.send(proc, b"frame 3")  # after the write: a write of its own
    await eventually(lambda: len(writes) == 2, "the second write")
    proc.stdin.close()
    out, _ = await proc.communicate()
    assert out == b"frame 0\nframe 1\nframe 2\nframe 3\n"
    assert len(writes) == 2
    assert drops.total == 0


async def test_frames_for_a_child_gone_before_the_write_are_counted_dropped() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "pass", stdin=asyncio.subprocess.PIPE
    )
    drops = Drops()
    current: list[asyncio.subprocess.Process | None] = [proc]
    batch = FrameBatch(lambda: current[0], drops, 1 << 20)
    assert batch.send(proc, b"a")
    assert batch.send(proc, b"b")
    current[0] = None  # replaced (restarting) before the write
    await eventually(lambda: drops.total == 2, "both frames counted dropped")
    assert not batch.send(None, b"c")  # control: no child at all is a drop at once
    assert drops.total == 3
    await proc.wait()
