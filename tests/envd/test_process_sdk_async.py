"""process.Process through the e2b Python SDK's AsyncSandbox (E2B_DEBUG → the session envd)."""

from __future__ import annotations

import asyncio
import time

import pytest
from e2b import AsyncSandbox, CommandExitException, NotFoundException, PtySize, TimeoutException


@pytest.fixture
async def asbx(sdk_env):
    sandbox = await AsyncSandbox.create()
    before = {p.pid for p in await sandbox.commands.list()}
    yield sandbox
    for info in await sandbox.commands.list():  # kill whatever a failing test left behind
        if info.pid not in before:
            await sandbox.commands.kill(info.pid)


async def wait_not_listed(sbx, pid: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pid not in [p.pid for p in await sbx.commands.list()]:
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"process {pid} still running")


async def test_run_streams_and_exit_code(asbx):
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    r = await asbx.commands.run("echo a; sleep 0.5; echo b",
                                on_stdout=lambda s: seen.append((time.monotonic() - t0, s)))
    assert r.stdout == "a\nb\n"
    assert seen[-1][0] - seen[0][0] > 0.4  # streamed as printed, not buffered to the end
    with pytest.raises(CommandExitException) as info:
        await asbx.commands.run("echo e >&2; exit 2")
    assert (info.value.exit_code, info.value.stderr) == (2, "e\n")


async def test_timeout_is_enforced_by_the_server(asbx):
    # py3.11: the async SDK relies on the server deadline (spike P3).
    t0 = time.monotonic()
    with pytest.raises(TimeoutException):
        await asbx.commands.run("sleep 10; echo finished", timeout=1)
    assert time.monotonic() - t0 < 3
    await asyncio.sleep(0.2)
    procs = await asbx.commands.list()
    assert not [p for p in procs if "sleep 10; echo finished" in p.args]


async def test_user_envs_cwd(asbx):
    r = await asbx.commands.run("id -un; echo $X; pwd", user="root", envs={"X": "y"}, cwd="/")
    assert r.stdout == "root\ny\n/\n"


async def test_background_survives_disconnect_and_reconnect(asbx):
    handle = await asbx.commands.run("read line; echo got-$line", background=True, stdin=True)
    await handle.disconnect()
    await asyncio.sleep(0.2)
    assert handle.pid in [p.pid for p in await asbx.commands.list()]
    out: list[str] = []
    again = await asbx.commands.connect(handle.pid, on_stdout=out.append)
    await asbx.commands.send_stdin(handle.pid, "x\n")
    result = await again.wait()
    assert result.stdout == "got-x\n" and out == ["got-x\n"]
    await wait_not_listed(asbx, handle.pid)


async def test_stream_input_is_live(asbx):
    out: list[str] = []
    handle = await asbx.commands.run("cat", background=True, stdin=True, on_stdout=out.append)
    async with asbx.commands.stream_input(handle.pid) as stdin:
        await stdin.send("one\n")
        deadline = time.monotonic() + 5
        while "".join(out) != "one\n" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert "".join(out) == "one\n"  # delivered while the input stream is still open
        await stdin.send(b"two\n")
    await asbx.commands.close_stdin(handle.pid)
    assert (await handle.wait()).stdout == "one\ntwo\n"


async def test_kill_background(asbx):
    handle = await asbx.commands.run("sleep 30", background=True)
    assert await asbx.commands.kill(handle.pid) is True
    with pytest.raises(CommandExitException) as info:
        await handle.wait()
    assert info.value.exit_code == -1 and info.value.error == "signal: killed"
    await wait_not_listed(asbx, handle.pid)
    assert await asbx.commands.kill(handle.pid) is False


async def test_connect_unknown(asbx):
    with pytest.raises(NotFoundException):
        await asbx.commands.connect(876543)


async def test_pty(asbx):
    data: list[bytes] = []
    pty = await asbx.pty.create(PtySize(rows=24, cols=80), on_data=data.append)
    await asbx.pty.resize(pty.pid, PtySize(rows=50, cols=132))
    await asbx.pty.send_stdin(pty.pid, b"stty size\n")
    deadline = time.monotonic() + 10
    while b"50 132" not in b"".join(data) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert b"50 132" in b"".join(data)
    assert await asbx.pty.kill(pty.pid) is True
    with pytest.raises(CommandExitException):
        await pty.wait()
    await wait_not_listed(asbx, pty.pid)
