"""Global rank <-> (pp, cp, ep, tp) coordinates, and the process groups built from them.

Rank order: TP innermost (a TP group sits on consecutive ranks, hence on one node,
where the fast links are), then EP (the expert-parallel group: consecutive TP groups, whose
MoE layers split the experts and exchange tokens all-to-all), then CP, then PP outermost
(stages may span nodes):

    global_rank = ((pp_rank * cp_size + cp_rank) * ep_size + ep_rank) * tp_size + tp_rank
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.comm.groups import AxisGroup


@dataclass(frozen=True)
class Coords:
    pp: int
    cp: int
    tp: int
    ep: int = 0


@dataclass(frozen=True)
class Topology:
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.cp_size * self.ep_size

    def coords(self, global_rank: int) -> Coords:
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"global_rank={global_rank} outside world_size={self.world_size}")
        tp = global_rank % self.tp_size
        ep = global_rank // self.tp_size % self.ep_size
        cp = global_rank // (self.tp_size * self.ep_size) % self.cp_size
        pp = global_rank // (self.tp_size * self.ep_size * self.cp_size)
        return Coords(pp, cp, tp, ep)

    def global_rank(self, c: Coords) -> int:
        return ((c.pp * self.cp_size + c.cp) * self.ep_size + c.ep) * self.tp_size + c.tp

    def axis_ranks(self, global_rank: int, axis: str) -> tuple[int, ...]:
        """Global ranks of `global_rank`'s group along `axis` ("tp", "ep", "cp" or "pp"), in order."""
        c = self.coords(global_rank)
        size = {"tp": self.tp_size, "ep": self.ep_size, "cp": self.cp_size, "pp": self.pp_size}[axis]
        return tuple(self.global_rank(Coords(**{**c.__dict__, axis: i})) for i in range(size))

    def all_axis_groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along `axis`, each once (every rank must create all of them)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.axis_ranks(r, axis))
        return list(seen)


@dataclass(frozen=True)
class Groups:
    """This rank's place in the world: one AxisGroup per parallel axis."""

    global_rank: int
    world_size: int
    tp: AxisGroup
    pp: AxisGroup
    cp: AxisGroup
    ep: AxisGroup = field(default_factory=lambda: AxisGroup.single("ep"))
    """The MoE layers' expert-parallel group (attention is replicated over it)."""

    @classmethod
    def single(cls) -> "Groups":
        return cls(0, 1, AxisGroup.single("tp"), AxisGroup.single("pp"), AxisGroup.single("cp"), AxisGroup.single("ep"))

    @property
    def is_driver(self) -> bool:
        """Global rank 0 schedules and serves clients."""
        return self.global_rank == 0

    @property
    def is_sampler(self) -> bool:
        """The rank that samples and reports tokens: last stage, first TP, EP and CP rank."""
        return self.pp.is_last and self.tp.rank == 0 and self.cp.rank == 0 and self.ep.rank == 0
