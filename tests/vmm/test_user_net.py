"""User-mode networking keeps the guest off the host (issue 14 item 13): slirp maps the
gateway 10.0.2.2 to the host's loopback, where the API, the proxy and other sandboxes'
forwarded ports listen. `UserNet` is restricted by default (only its forwarded envd port
works); the unrestricted form, which the same check shows reaching the host, is kept
for the test that proves the check can fail."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from host.vmm import BootTimeouts, QemuDriver, UserNet
from host.vmm.image import GuestImage

from .conftest import private_root

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

PROBE = ("import socket, sys\n"
         "try:\n"
         "    socket.create_connection(('10.0.2.2', int(sys.argv[1])), timeout=5).close()\n"
         "    print('reached')\n"
         "except OSError as e:\n"
         "    print('refused', e)\n")


@pytest.mark.parametrize("restrict", [True, False], ids=["restricted", "open"])
async def test_guest_reaches_host_loopback_only_when_unrestricted(
        guest_image: GuestImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        restrict: bool) -> None:
    from e2b import Sandbox

    listener = socket.create_server(("127.0.0.1", 0))   # a host service on loopback
    port = listener.getsockname()[1]
    spec = guest_image.vm_spec(root=private_root(guest_image, tmp_path), name="test-usernet",
                               mem_mib=256, network=UserNet(restrict=restrict))
    driver = QemuDriver(run_dir=tmp_path / "run")
    try:
        vm = await driver.boot(spec, timeouts=BootTimeouts(envd_ready_s=240))
        monkeypatch.setenv("E2B_DEBUG", "true")
        monkeypatch.setenv("E2B_SANDBOX_URL", vm.envd_url)   # the forwarded port works
        sbx = Sandbox.create()
        sbx.files.write("/tmp/probe.py", PROBE)
        out = await asyncio.to_thread(sbx.commands.run, f"python3 /tmp/probe.py {port}",
                                      timeout=60)
        assert out.stdout.startswith("refused" if restrict else "reached"), out.stdout
        await vm.kill()
    finally:
        listener.close()
        await driver.aclose()
