"""Ranks started by an MPI launcher (`mpirun`/`mpiexec -n N meshserve worker CONFIG`, or
`srun --mpi=pmi2` under Slurm): MPI gives each process its rank, and mpi4py bootstraps
torch.distributed. Rank 0 picks a free port on its own address and broadcasts address and
port to every rank; from there on, torch.distributed and ZeroMQ carry everything, as under
torchrun.

mpi4py is optional (`pip install 'meshserve[mpi]'`) and imported only here, only under MPI.
"""

from __future__ import annotations


from meshserve.configs.schema import ClusterConfig
from meshserve.launcher.env import MpiWorld, RankEnv
from meshserve.launcher.network import NetworkError, free_port, host_address, interface_address
from meshserve.launcher.errors import StartupError

BOOTSTRAP_BYTES = 256


def _master_host(cluster: ClusterConfig, whole_world_here: bool) -> str:
    """Where rank 0 listens for the others: the configured interface's address; else the
    loopback address when every rank is on this node; else the host name's address."""
    if cluster.interface:
        return interface_address(cluster.interface)
    return "127.0.0.1" if whole_world_here else host_address()


def bootstrap(world: MpiWorld, cluster: ClusterConfig) -> RankEnv:
    """Broadcasts from MPI rank 0 the address and port where torch.distributed meets;
    returns this rank's place in the world. Every rank fails alike if rank 0 cannot listen."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise StartupError(f"started by {world.launcher} (rank {world.rank} of {world.size}), but mpi4py is not "
                           f"installed: pip install 'meshserve[mpi]' (and an MPI library, e.g. the `mpich` "
                           f"package, or the cluster's own)") from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != world.size or comm.Get_rank() != world.rank:
        raise StartupError(f"{world.launcher} says rank {world.rank} of {world.size}, but MPI says rank "
                           f"{comm.Get_rank()} of {comm.Get_size()}")
    local_rank, local_size = world.local_rank, world.local_size
    if local_rank is None or local_size is None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        local_rank, local_size = node.Get_rank(), node.Get_size()
        node.Free()
    buf = bytearray(BOOTSTRAP_BYTES)
    if world.rank == 0:
        try:
            host = _master_host(cluster, local_size == world.size)
            text = f"{host} {free_port(host)}"
        except (NetworkError, OSError) as e:
            text = f"! MPI rank 0 cannot listen for the other ranks: {e}"
        data = text.encode()[:BOOTSTRAP_BYTES]
        buf[: len(data)] = data
    # NOTE: a raw byte buffer (Bcast), not comm.bcast: lower-case mpi4py calls pickle.
    comm.Bcast([buf, MPI.BYTE], root=0)
    text = bytes(buf).rstrip(b"\0").decode()
    if text.startswith("!"):
        raise StartupError(text[2:])
    host, port = text.split()
    return RankEnv(global_rank=world.rank, local_rank=local_rank, world_size=world.size,
                   local_world_size=local_size, master_addr=host, master_port=int(port),
                   node_rank=world.rank // max(1, local_size), launcher=world.launcher)
