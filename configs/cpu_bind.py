"""Which cores each rank of a node runs on (device.cpu_bind), in Linux's CPU-list syntax
("0-3,8"): checked before any rank starts, split the same way on every rank.

`auto` splits the cores the launcher may use (its affinity mask) into one equal,
contiguous share per local rank; with more local ranks than cores each rank takes one core,
round-robin. `none` leaves placement to the OS. An explicit list gives each local rank its
own cores.
"""

from __future__ import annotations


def parse_cpu_list(text: str | int) -> list[int]:
    """ "0-3,8" -> [0, 1, 2, 3, 8]; an int is one core. Raises ValueError with the text."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"core {text} is negative")
        return [text]
    cores: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (e.g. \"0-3,8\")")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{part!r} in {text!r} runs backwards")
        cores.extend(range(first, last + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"{text!r} names a core twice")
    return cores


def auto_share(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """Local rank `local_rank`'s share of `cores` under `auto`."""
    cores = sorted(cores)
    if local_world_size >= len(cores):
        return [cores[local_rank % len(cores)]]
    per = len(cores) // local_world_size
    return cores[local_rank * per:(local_rank + 1) * per]


def rank_cores(bind: str | list, cores: list[int], local_rank: int, local_world_size: int) -> list[int] | None:
    """Local rank `local_rank`'s cores under device.cpu_bind `bind` (None: `none`, unbound)."""
    if bind == "none":
        return None
    if bind == "auto":
        return auto_share(cores, local_rank, local_world_size)
    return parse_cpu_list(bind[local_rank])


def thread_share(mine: list[int] | None, cores: list[int], local_world_size: int) -> int:
    """The most intra-op threads a rank of `local_world_size` on `cores` runs: its own
    cores (`mine`), or, unbound, its equal share of the node's (at least one)."""
    return len(mine) if mine is not None else max(1, len(cores) // max(1, local_world_size))


def cpu_bind_problems(bind: str | list, ranks_per_node: int, cores: list[int]) -> list[str]:
    """An explicit device.cpu_bind: one list per local rank, of cores that exist here, with
    no core in two lists."""
    if isinstance(bind, str):
        return []
    if len(bind) != ranks_per_node:
        return [f"device.cpu_bind has {len(bind)} core lists for {ranks_per_node} ranks per node (one list per "
                f"local rank)"]
    problems, owner = [], {}
    for i, item in enumerate(bind):
        try:
            listed = parse_cpu_list(item)
        except ValueError as e:
            problems.append(f"device.cpu_bind[{i}]: {e}")
            continue
        missing = sorted(set(listed) - set(cores))
        if missing:
            problems.append(f"device.cpu_bind[{i}]={item!r} names cores {missing} that this node does not have or "
                            f"may not use (it may use {_ranges(cores)})")
        for core in listed:
            if core in owner:
                problems.append(f"device.cpu_bind[{owner[core]}] and [{i}] both take core {core}: ranks would fight "
                                f"over it")
            owner.setdefault(core, i)
    return problems


def _ranges(cores: list[int]) -> str:
    out, cores = [], sorted(cores)
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)
