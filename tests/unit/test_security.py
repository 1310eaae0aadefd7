"""Secure defaults and the config side of security: client-facing sockets on loopback, the
secrets never printed (`meshserve check`, errors, repr) and filled from the launcher's
environment, and checkpoint indexes that cannot point the server at other files."""

from __future__ import annotations

import inspect
import ipaddress
import json
import stat
from pathlib import Path

import pytest

from meshserve.client import AsyncClient, Client
from meshserve.configs import ConfigError, load_config
from meshserve.configs.model_info import read_model_info, safetensors_shards
from meshserve.configs.schema import Config, redacted
from meshserve.launcher.cli import main
from meshserve.launcher.env import RankEnv, secrets_from_environ

SECRET, API_KEY = "s3cr3t-value", "k3y-value"


def _is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback


def test_client_facing_sockets_bind_loopback_by_default():
    server = Config().server
    assert server.zmq == "tcp://127.0.0.1:5555" and server.http == "127.0.0.1:8000"
    zmq_host = server.zmq.removeprefix("tcp://").rpartition(":")[0]
    http_host = server.http.rpartition(":")[0]
    assert _is_loopback(zmq_host) and _is_loopback(http_host)
    assert server.secret is None and server.api_key is None
    for cls in (Client, AsyncClient):  # and the clients' default is that address
        assert inspect.signature(cls).parameters["address"].default == server.zmq
    # on one node the ranks meet on loopback (the control plane is unix sockets in a private
    # directory: tests/unit/test_ipc_control_plane.py)
    assert Config().cluster.master_addr is None and _is_loopback(RankEnv().master_addr)


def test_secrets_are_masked_when_printed(capsys):
    config = load_config(None, [f"server.secret={SECRET}", f"server.api_key={API_KEY}"])
    assert (config.server.secret, config.server.api_key) == (SECRET, API_KEY)
    assert redacted(config)["server"]["secret"] == "***" and redacted(config)["server"]["api_key"] == "***"
    assert redacted(Config())["server"]["secret"] is None
    assert SECRET not in repr(config) and API_KEY not in repr(config)
    assert main(["check", "--set", f"server.secret={SECRET}", "--set", f"server.api_key={API_KEY}"]) == 0
    out = capsys.readouterr().out
    assert "secret: '***'" in out and "api_key: '***'" in out
    assert SECRET not in out and API_KEY not in out


@pytest.mark.parametrize("value", ["12345", "''", "[a, b]"])
def test_a_bad_secret_is_an_error_that_does_not_echo_it(value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"server.secret={value}"])
    assert str(e.value).startswith("<builtin default>: server.secret")
    assert "12345" not in str(e.value) and "got" not in str(e.value)


def test_secrets_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHSERVE_SECRET", "from-env")
    monkeypatch.setenv("MESHSERVE_API_KEY", "key-from-env")
    config = secrets_from_environ(load_config(None))
    assert (config.server.secret, config.server.api_key) == ("from-env", "key-from-env")
    # the config wins over the environment; an empty variable is unset
    config = secrets_from_environ(load_config(None, ["server.secret=from-config"]))
    assert (config.server.secret, config.server.api_key) == ("from-config", "key-from-env")
    monkeypatch.setenv("MESHSERVE_SECRET", "")
    monkeypatch.delenv("MESHSERVE_API_KEY")
    config = secrets_from_environ(load_config(None))
    assert config.server.secret is None and config.server.api_key is None
    assert config == Config()


def test_shared_memory_segment_is_private(tmp_path):
    """The TP collectives' segment in /dev/shm carries every step's activations: mode 0600,
    and a name that already exists (planted by another user, or a link) is refused."""
    from meshserve.comm.groups import AxisGroup
    from meshserve.comm.shm import ShmCommunicator, new_segment_name

    name = new_segment_name()
    path = Path("/dev/shm") / name
    shm = ShmCommunicator(AxisGroup.single("tp"), 1024, 5.0, name)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        shm.attached(name)
    assert not path.exists()
    path.symlink_to(tmp_path / "elsewhere")
    try:
        with pytest.raises(FileExistsError):
            ShmCommunicator(AxisGroup.single("tp"), 1024, 5.0, name)
        assert not (tmp_path / "elsewhere").exists()
    finally:
        path.unlink()


# ------------------------------------------------------------------ checkpoint paths

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)


def _checkpoint(d: Path, shards: list) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(LLAMA))
    weight_map = {f"model.layers.{i}.weight": s for i, s in enumerate(shards)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors",
                                   "..", "C:\\Windows\\x.safetensors", "..\\outside.safetensors", ""])
def test_index_cannot_name_a_shard_outside_the_model_directory(tmp_path, shard):
    d = _checkpoint(tmp_path / "model", ["model-00001-of-00002.safetensors", shard])
    with pytest.raises(ConfigError) as e:
        safetensors_shards(d)
    assert f"names the shard {shard!r}, which is not a file inside the model directory" in str(e.value)
    with pytest.raises(ConfigError, match="not a file inside the model directory"):
        read_model_info(str(d))  # before any rank starts
    from meshserve.layers.weights import _safetensors_files

    with pytest.raises(ConfigError, match="not a file inside the model directory"):
        _safetensors_files(d)  # and where the weights are read


@pytest.mark.parametrize("weight_map", [["a.safetensors"], {"w": 3}, {"w": None}])
def test_index_of_the_wrong_shape_is_refused(tmp_path, weight_map):
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConfigError, match="weight_map must map tensor names to shard file names"):
        safetensors_shards(d)
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a safetensors index"):
        safetensors_shards(d)


def test_index_shards_inside_the_directory_are_accepted(tmp_path):
    d = _checkpoint(tmp_path / "model", ["b.safetensors", "a.safetensors", "sub/c.safetensors", "a.safetensors"])
    assert safetensors_shards(d) == [d / "a.safetensors", d / "b.safetensors", d / "sub" / "c.safetensors"]
    assert read_model_info(str(d)).num_hidden_layers == 2
    assert safetensors_shards(tmp_path) is None  # no index
