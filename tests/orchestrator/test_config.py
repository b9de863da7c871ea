"""host.config: environment + flags (flags win), validation; the start banner."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from host.__main__ import banner
from host.api import ApiKeys
from host.config import Config, ConfigError, parse_config


def test_defaults() -> None:
    cfg = parse_config([], {})
    assert cfg == Config()
    assert cfg.state_dir == Path("/var/lib/aenv")
    assert (cfg.api_port, cfg.proxy_port, cfg.domain) == (3000, 3001, "sbx.localhost")
    assert cfg.repository_spec == "posix_fs:/var/lib/aenv/repo"
    assert cfg.vmm == "auto" and cfg.tls is False


def test_env_then_flags() -> None:
    env = {"AENV_STATE_DIR": "/srv/aenv", "AENV_API_PORT": "4000", "AENV_TLS": "yes",
           "AENV_DOMAIN": "sbx.example.test", "AENV_MEMORY_MB": "256"}
    cfg = parse_config(["--api-port", "4100", "--no-tls"], env)
    assert cfg.state_dir == Path("/srv/aenv") and cfg.db_path == Path("/srv/aenv/state.db")
    assert cfg.api_port == 4100 and cfg.tls is False
    assert cfg.domain == "sbx.example.test" and cfg.memory_mb == 256
    cfg = parse_config(["--cache-mib", "512"], {
        "AENV_CACHE_DIR": "/srv/cache",
        "AENV_REPOSITORY": "oss://b/p?endpoint=http://127.0.0.1:9000&region=us-east-1"})
    assert cfg.cache_dir == Path("/srv/cache") and cfg.cache_mib == 512
    assert cfg.repository_spec.startswith("oss://b/p")
    # the node's builders: on unless the environment or a flag says otherwise
    assert cfg.builders is True
    assert parse_config([], {"AENV_BUILDERS": "0"}).builders is False
    assert parse_config(["--builders"], {"AENV_BUILDERS": "0"}).builders is True


def test_tcg_code_buffer_reaches_the_qemu_driver(tmp_path) -> None:
    """--tcg-tb-mib / AENV_TCG_TB_MIB: parsed here once and handed down to the driver that
    writes `-accel tcg,tb-size=` (it no longer reads the environment itself)."""
    from host.runtime.config import RuntimeConfig
    from host.runtime.machines import make_driver
    from host.vmm.qemu.cmdline import TCG_TB_MIB

    assert parse_config([], {}).tcg_tb_mib == TCG_TB_MIB
    assert parse_config([], {"AENV_TCG_TB_MIB": "32"}).tcg_tb_mib == 32
    assert parse_config(["--tcg-tb-mib", "0"], {"AENV_TCG_TB_MIB": "32"}).tcg_tb_mib == 0
    rt = RuntimeConfig(state_dir=tmp_path, run_dir=tmp_path / "rt", vmm="qemu")
    assert make_driver(rt).tcg_tb_mib == TCG_TB_MIB  # type: ignore[attr-defined]
    rt = RuntimeConfig(state_dir=tmp_path, run_dir=tmp_path / "rt", vmm="qemu", tcg_tb_mib=32)
    assert make_driver(rt).tcg_tb_mib == 32  # type: ignore[attr-defined]


def test_vmm_firecracker_and_its_binaries() -> None:
    cfg = parse_config(["--vmm", "firecracker", "--firecracker", "/opt/fc/firecracker"],
                       {"AENV_JAILER": "off", "AENV_JAILER_UID": "123"})
    assert (cfg.vmm, cfg.firecracker, cfg.jailer) == ("firecracker", "/opt/fc/firecracker",
                                                      "off")
    assert (cfg.jailer_uid, cfg.jailer_gid) == (123, 0)
    assert parse_config([], {"AENV_VMM": "firecracker"}).vmm == "firecracker"
    assert (Config().firecracker, Config().jailer) == ("firecracker", "auto")


@pytest.mark.parametrize(("argv", "env"), [
    (["--api-port", "3001"], {}),
    ([], {"AENV_API_PORT": "70000"}),
    ([], {"AENV_TLS": "maybe"}),
    ([], {"AENV_API_PORT": "x"}),
    ([], {"AENV_VMM": "cloud-hypervisor"}),
    ([], {"AENV_JAILER_UID": "-1"}),
    ([], {"AENV_TCG_TB_MIB": "-1"}),
    (["--domain", "http://x"], {}),
    (["--run-dir", "/tmp/" + "x" * 80], {}),
    (["--cache-mib", "8"], {}),
    (["--repository", "oss://bucket/prefix?endpoint=http://127.0.0.1:9000"], {}),
])
def test_invalid(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        parse_config(argv, env)


def test_banner_names_the_sdk_variables_and_the_key_file_not_the_key(tmp_path) -> None:
    state = tmp_path / "aenv state"      # a path the shell must get quoted
    state.mkdir()
    ApiKeys.load_or_create(state / "api_keys")
    key = (state / "api_keys").read_text().strip()
    text = banner(Config(api_port=3000, proxy_port=3001, state_dir=state))
    assert "E2B_API_URL=http://127.0.0.1:3000" in text
    assert "E2B_SANDBOX_URL=http://127.0.0.1:3001" in text
    assert f"export E2B_API_KEY=$(head -1 '{state}/api_keys')" in text
    assert key not in text
    # and that line gives a shell the key
    line = next(ln for ln in text.splitlines() if "E2B_API_KEY" in ln)
    out = subprocess.run(["bash", "-c", f'{line}; printf %s "$E2B_API_KEY"'],
                         capture_output=True, text=True, check=True).stdout
    assert out == key
    assert "E2B_DOMAIN=sbx.localhost" in banner(Config(tls=True))
    assert "/var/lib/aenv/api_keys" in banner(Config())
