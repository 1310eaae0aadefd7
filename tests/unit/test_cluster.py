"""The cluster section and the launchers' views of a rank, without starting any: topology
errors before any rank starts (with the numbers), each launcher's variables, the start-up
checks every rank runs on the facts it all-gathered, and the rendezvous a node would join."""

from __future__ import annotations

import pytest

from meshserve.configs import ConfigError, load_config
from meshserve.configs.validate import check_config
from meshserve.launcher.env import RankEnv, mpi_world_from_environ, rank_env_from_environ
from meshserve.launcher.startup import RankFacts, config_hash, world_problems

LAUNCHER_VARS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_RANK", "CROSS_RANK",
                 "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK",
                 "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"]


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def tiny(tiny_checkpoints, *overrides: str):
    """The tiny Llama with a secret, which several nodes need (tests/unit/test_config_errors.py)."""
    return load_config(None, [f"model.path={tiny_checkpoints['llama']}", "server.secret=test-secret", *overrides])


def check_error(config) -> str:
    with pytest.raises(ConfigError) as e:
        check_config(config, "two.yaml")
    return str(e.value)


def test_cluster_defaults_to_one_node_holding_the_world(tiny_checkpoints):
    config = tiny(tiny_checkpoints, "parallel.tensor=2", "parallel.pipeline=2")
    assert config.cluster.nodes == 1 and config.ranks_per_node == 4
    check_config(config, "two.yaml")
    two = tiny(tiny_checkpoints, "parallel.tensor=2", "parallel.pipeline=2", "cluster.nodes=2")
    assert two.ranks_per_node == 2
    check_config(two, "two.yaml")


def test_cluster_errors_name_the_keys_and_numbers(tiny_checkpoints):
    msg = check_error(tiny(tiny_checkpoints, "parallel.tensor=2", "parallel.pipeline=2", "cluster.nodes=3"))
    assert msg == ("two.yaml: cluster.nodes=3 does not divide the world size (parallel.tensor x pipeline x context "
                   "= 2 x 2 x 1 = 4) (try cluster.nodes 1, 2 or 4, or set cluster.ranks_per_node)")
    msg = check_error(tiny(tiny_checkpoints, "parallel.tensor=2", "parallel.pipeline=2", "cluster.nodes=2",
                           "cluster.ranks_per_node=4"))
    assert ("cluster.nodes=2 x cluster.ranks_per_node=4 = 8 ranks, but the world size is parallel.tensor x "
            "pipeline x context = 2 x 2 x 1 = 4") in msg
    # tp = 4 over two nodes of two ranks: a TP group would straddle them
    msg = check_error(tiny(tiny_checkpoints, "parallel.tensor=4", "cluster.nodes=2"))
    assert ("parallel.tensor=4 does not divide cluster.ranks_per_node=2: a tensor-parallel group would span nodes "
            "(tensor groups stay inside a node, pipeline stages may cross nodes; try parallel.tensor 1 or 2 with "
            "more pipeline stages, or more ranks per node)") in msg


def test_unknown_cluster_key_and_bad_port_fail_on_load(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("cluster:\n  node: 2\n  master_port: 70000\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert "cluster.node: unknown key" in str(e.value) and "cluster.master_port" in str(e.value)


def test_config_hash_covers_the_resolved_config_but_not_the_interface(tiny_checkpoints):
    base = tiny(tiny_checkpoints, "parallel.tensor=2")
    assert config_hash(base) == config_hash(tiny(tiny_checkpoints, "parallel.tensor=2", "cluster.interface=eth1"))
    assert config_hash(base) != config_hash(tiny(tiny_checkpoints, "parallel.tensor=2", "scheduler.max_num_seqs=8"))


def test_torchrun_and_deepspeed_variables(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("LOCAL_RANK", "1")
    clean_env.setenv("MASTER_ADDR", "10.0.0.1")
    clean_env.setenv("MASTER_PORT", "29500")
    clean_env.setenv("LOCAL_SIZE", "2")  # deepspeed's name for the ranks on this node
    clean_env.setenv("CROSS_RANK", "1")
    env = rank_env_from_environ()
    assert env == RankEnv(3, 1, 4, 2, "10.0.0.1", 29500, node_rank=1, launcher="deepspeed")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    clean_env.setenv("GROUP_RANK", "1")
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    clean_env.delenv("LOCAL_SIZE")
    clean_env.delenv("CROSS_RANK")
    assert rank_env_from_environ() == RankEnv(3, 1, 4, 2, "10.0.0.1", 29500, node_rank=1, launcher="torchrun")


def test_mpi_variables(clean_env):
    assert mpi_world_from_environ() is None
    clean_env.setenv("PMI_RANK", "2")
    clean_env.setenv("PMI_SIZE", "4")
    world = mpi_world_from_environ()
    assert (world.rank, world.size, world.local_rank, world.local_size) == (2, 4, None, None)
    clean_env.setenv("MPI_LOCALRANKID", "0")
    clean_env.setenv("MPI_LOCALNRANKS", "2")
    world = mpi_world_from_environ()
    assert (world.local_rank, world.local_size) == (0, 2)
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "8")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    world = mpi_world_from_environ()
    assert (world.rank, world.size, world.local_rank, world.local_size, world.launcher) == (1, 8, 1, 4,
                                                                                            "mpirun (Open MPI)")


def test_no_launcher_says_how_to_start(clean_env):
    with pytest.raises(RuntimeError, match="start `meshserve worker` under torchrun, mpirun/mpiexec or deepspeed"):
        rank_env_from_environ()


def facts(config, hosts, local=2, config_hash_of=None):
    h = config_hash(config)
    return [RankFacts(config_hash_of.get(r, h) if config_hash_of else h, config.world_size, local, host)
            for r, host in enumerate(hosts)]


def test_start_up_checks_on_the_gathered_facts(tiny_checkpoints):
    config = tiny(tiny_checkpoints, "parallel.tensor=2", "parallel.pipeline=2", "cluster.nodes=2")
    env = RankEnv(0, 0, 4, 2, launcher="torchrun")
    assert world_problems(config, env, facts(config, ["a", "a", "b", "b"])) == []
    # configs that differ: both hashes, and where each was loaded
    got = world_problems(config, env, facts(config, ["a", "a", "b", "b"], config_hash_of={2: "f" * 16, 3: "f" * 16}))
    assert got == [f"the ranks loaded different configs: config hash {config_hash(config)} on ranks 0-1 (host a, "
                   f"world size 4) but {'f' * 16} on ranks 2-3 (host b, world size 4); start every node with the "
                   f"same config file and --set overrides"]
    # the launcher's world is not the config's
    got = world_problems(config, RankEnv(0, 0, 2, 2, launcher="torchrun"), facts(config, ["a", "a"]))
    assert got == ["torchrun started 2 ranks but the config needs parallel.tensor x pipeline x context = "
                   "2 x 2 x 1 = 4"]
    got = world_problems(config, env, facts(config, ["a"] * 4, local=4))
    assert got == ["torchrun started 4 ranks per node but the config has cluster.nodes=2 x cluster.ranks_per_node=2"]
    # ranks placed round-robin over nodes: a TP group would straddle two hosts
    got = world_problems(config, env, facts(config, ["a", "b", "a", "b"]))
    assert got and got[0].startswith("the tensor-parallel group of ranks 0-1 spans hosts a, b")
    assert RankFacts.decode(facts(config, ["host with space"])[0].encode()).host == "host with space"


def test_multinode_serve_needs_a_node_rank_and_a_master(tiny_checkpoints):
    from meshserve.launcher.spawn import _launch_config

    config = tiny(tiny_checkpoints, "parallel.tensor=2", "parallel.pipeline=2", "cluster.nodes=2")
    with pytest.raises(ConfigError, match=r"start `meshserve serve CONFIG --node-rank K` on each node, K = 0 \.\. 1"):
        _launch_config(config, None, 30)
    with pytest.raises(ConfigError, match="got 2"):
        _launch_config(config, 2, 30)
    with pytest.raises(ConfigError, match="set cluster.master_addr"):
        _launch_config(config, 1, 30)
    config = tiny(tiny_checkpoints, "parallel.tensor=2", "parallel.pipeline=2", "cluster.nodes=2",
                  "cluster.master_addr=10.0.0.1", "cluster.master_port=29400", "cluster.rendezvous_timeout=7")
    launch = _launch_config(config, 1, 30)
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (2, 2, 2)
    assert launch.rdzv_backend == "static" and launch.rdzv_endpoint == "10.0.0.1:29400"
    assert launch.rdzv_configs["rank"] == 1 and launch.rdzv_configs["timeout"] == 7
    with pytest.raises(ConfigError, match="cluster.nodes=1"):
        _launch_config(tiny(tiny_checkpoints, "parallel.tensor=2"), 1, 30)


@pytest.mark.parametrize("name", ["smollm2-2nodes.yaml", "llama3-8b-2gpu-nodes.yaml"])
def test_multinode_example_configs_hold_their_world(name):
    from pathlib import Path

    from meshserve.configs.validate import cluster_problems

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / name, ["server.secret=from-the-env"])
    assert config.cluster.nodes == 2 and config.cluster.nodes * config.ranks_per_node == config.world_size
    assert cluster_problems(config) == []
    if config.model.path.startswith("builtin:"):
        check_config(config, name)


def test_a_ranks_reported_reason_reaches_the_elastic_agent(tmp_path, monkeypatch):
    """What torch elastic's agent reads from a failed rank's error file (launcher/failure_report.py):
    the reason, with the time it was written; nothing for a rank that reported none."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from meshserve.launcher.failure_report import report_failure, reported_reason

    path = tmp_path / "error.json"
    silent = ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file=str(path))
    assert reported_reason(silent.error_file_data) is None  # torch's placeholder is {"message": "<NONE>"}
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    report_failure("not written anywhere")
    assert not path.exists()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    report_failure("rank 1 sent no heartbeat for 4 s")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert reported_reason(failure.error_file_data) == failure.message == "rank 1 sent no heartbeat for 4 s"
    assert failure.timestamp > 0


def test_replicas_fit_whole_on_nodes_and_are_placed_replica_by_replica(tiny_checkpoints):
    from meshserve.launcher.serve_replicas import node_replicas
    from meshserve.launcher.replicas import core_shares, replica_overrides

    config = tiny(tiny_checkpoints, "parallel.data=2", "parallel.tensor=2")
    assert (config.world_size, config.total_ranks, config.ranks_per_node) == (2, 4, 4)
    assert node_replicas(config, 0) == [0, 1]
    error = check_error(tiny(tiny_checkpoints, "parallel.data=2", "parallel.tensor=2", "cluster.nodes=2",
                             "cluster.ranks_per_node=3"))
    assert "cluster.nodes=2 x cluster.ranks_per_node=3 = 6 ranks, but the world size is parallel.data x tensor" in error
    error = check_error(tiny(tiny_checkpoints, "parallel.data=3", "parallel.pipeline=2", "cluster.nodes=2"))
    assert "parallel.data=3: a replica of 2 ranks (parallel.tensor x pipeline x context) does not fit whole in " \
           "cluster.ranks_per_node=3" in error
    two_nodes = tiny(tiny_checkpoints, "parallel.data=4", "cluster.nodes=2")
    assert node_replicas(two_nodes, 0) == [0, 1] and node_replicas(two_nodes, 1) == [2, 3]
    # 4 ranks on 4 cores: a core each, replica by replica; on 2 cores they share, one thread each
    shares = core_shares(config, cores=[0, 1, 2, 3])
    assert shares == [[0], [1], [2], [3]]
    sets = replica_overrides(config, 1, shares, 6001)
    assert sets[1::2] == ["parallel.data=1", "server.zmq=tcp://127.0.0.1:6001", "server.http=127.0.0.1:0",
                          "cluster.nodes=1", "cluster.ranks_per_node=2", "cluster.master_addr=null",
                          'device.cpu_bind=["2","3"]']
    assert core_shares(config, cores=[0, 1]) == [None] * 4
    assert replica_overrides(config, 0, [None] * 4, 6000)[-4:] == ["--set", "device.cpu_bind=none",
                                                                   "--set", "device.threads=1"]
    # what a replica's --set items make of the config: one replica, valid as it stands (2 cores: one each)
    two = tiny(tiny_checkpoints, "parallel.data=2")
    sets = replica_overrides(two, 1, core_shares(two, cores=[0, 1]), 6001)
    replica = load_config(None, [f"model.path={tiny_checkpoints['llama']}", "parallel.data=2", *sets[1::2]])
    assert replica.parallel.data == 1 and replica.device.cpu_bind == ["1"] and replica.total_ranks == 1
    check_config(replica, "replica.yaml")
