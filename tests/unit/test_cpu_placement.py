"""Where ranks run on the CPU: device.cpu_bind's CPU lists parsed and checked before any
rank starts (cores that do not exist, overlaps, a list count that is not the node's rank
count), `auto`'s split of the cores, and thread counts that never oversubscribe a node
(OMP_NUM_THREADS and device.threads capped, with the numbers)."""

from __future__ import annotations

import pytest

from meshserve.configs import ConfigError, load_config
from meshserve.configs.cpu_bind import auto_share, cpu_bind_problems, parse_cpu_list
from meshserve.configs.cpu_features import usable_cores
from meshserve.configs.schema import DeviceConfig
from meshserve.configs.validate import check_config
from meshserve.launcher import env as launcher_env
from meshserve.launcher.env import cpu_placement


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list(5) == [5] and parse_cpu_list(" 2 ") == [2]
    for bad, message in [("3-1", "runs backwards"), ("0,0", "names a core twice"), ("a-b", "not a CPU list"),
                         ("", "not a CPU list"), ("1-", "not a CPU list")]:
        with pytest.raises(ValueError, match=message):
            parse_cpu_list(bad)


def test_auto_splits_the_cores_evenly_and_round_robin_when_ranks_outnumber_them():
    cores = [0, 1, 2, 3, 4, 5, 6, 7]
    assert [auto_share(cores, r, 2) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [auto_share(cores, r, 3) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert [auto_share([0, 1], r, 3) for r in range(3)] == [[0], [1], [0]]
    assert auto_share([4, 6], 0, 1) == [4, 6]  # a launcher's mask, not 0..n


def test_explicit_lists_are_checked_before_any_rank_starts(tiny_checkpoints):
    cores = [0, 1, 2, 3]
    assert cpu_bind_problems(["0-1", "2-3"], 2, cores) == []
    assert cpu_bind_problems("auto", 4, cores) == []
    assert cpu_bind_problems(["0-1", "2-3", "0"], 2, cores) == [
        "device.cpu_bind has 3 core lists for 2 ranks per node (one list per local rank)"]
    assert cpu_bind_problems(["0-2", "2-3"], 2, cores) == [
        "device.cpu_bind[0] and [1] both take core 2: ranks would fight over it"]
    assert cpu_bind_problems(["0", "7-9"], 2, cores) == [
        "device.cpu_bind[1]='7-9' names cores [7, 8, 9] that this node does not have or may not use (it may use 0-3)"]
    assert cpu_bind_problems(["0", "x"], 2, cores)[0].startswith("device.cpu_bind[1]: 'x' is not a CPU list")
    path = tiny_checkpoints["llama"]
    here = usable_cores()
    with pytest.raises(ConfigError, match=rf"device.cpu_bind\[1\]='{here[-1] + 1}' names cores \[{here[-1] + 1}\]"):
        check_config(load_config(None, [f"model.path={path}", "parallel.tensor=2",
                                        f"device.cpu_bind=['{here[0]}', '{here[-1] + 1}']"]))
    with pytest.raises(ConfigError, match="device.cpu_bind has 1 core lists for 2 ranks per node"):
        check_config(load_config(None, [f"model.path={path}", "parallel.tensor=2", f"device.cpu_bind=[{here[0]}]"]))
    with pytest.raises(ConfigError):
        load_config(None, [f"model.path={path}", "device.cpu_bind=sometimes"])


def test_threads_never_oversubscribe_the_node(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    auto = DeviceConfig()
    assert cpu_placement(auto, 0, 1, [0, 1]) == launcher_env.CpuPlacement(2, [0, 1])
    assert cpu_placement(auto, 1, 2, [0, 1]) == launcher_env.CpuPlacement(1, [1])
    assert cpu_placement(auto, 2, 3, [0, 1]) == launcher_env.CpuPlacement(1, [0])
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    capped = cpu_placement(auto, 0, 3, [0, 1])
    assert (capped.threads, capped.cores) == (1, [0])
    assert capped.capped == "OMP_NUM_THREADS=2 x 3 local ranks = 6 threads on 2 cores: capped at 1 thread per rank"
    assert cpu_placement(auto, 0, 1, [0, 1, 2, 3]) == launcher_env.CpuPlacement(2, [0, 1, 2, 3])  # fewer is fine
    config = DeviceConfig(threads=4, cpu_bind="none")
    unbound = cpu_placement(config, 0, 2, [0, 1, 2, 3])
    assert (unbound.threads, unbound.cores) == (2, None) and unbound.capped.startswith("device.threads=4 x 2")
    explicit = DeviceConfig(cpu_bind=["0", "1-3"])
    assert cpu_placement(explicit, 1, 2, [0, 1, 2, 3]) == launcher_env.CpuPlacement(2, [1, 2, 3])  # OMP's 2 fits
