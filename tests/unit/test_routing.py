"""The front door's routing (engine/serving/replicas/routing.py), plain Python: least loaded by
tokens, cache aware with the overload bound, conversations sticking to their replica,
failed replicas skipped."""

from __future__ import annotations

from meshserve.engine.serving.replicas.prefix_index import PrefixIndex, prefix_hashes
from meshserve.engine.serving.replicas.routing import Router

BS = 4


def send(router: Router, key, prompt, salt=None, exclude=frozenset()):
    route = router.route(prompt, salt, exclude)
    router.started(key, route, prompt, salt)
    return route


def test_least_loaded_counts_the_tokens_of_queued_and_running_requests():
    router = Router(3, "least_loaded", BS, capacity_blocks=100)
    assert [send(router, i, list(range(10))).replica for i in range(3)] == [0, 1, 2]  # ties: fewest routed
    router.produced(0, [1] * 5)  # replica 0 now holds 15 tokens, the others 10
    assert router.load(0) == 15 and router.load(1) == 10
    assert send(router, 3, list(range(2))).replica == 1
    router.finished(2)  # replica 2 is empty again
    assert router.load(2) == 0 and router.requests(2) == 0
    assert send(router, 4, list(range(50))).replica == 2
    assert router.load(2) == 50


def test_cache_aware_prefers_the_longest_cached_prefix_within_the_overload_bound():
    router = Router(2, "cache_aware", BS, capacity_blocks=100, balance_abs_tokens=40, balance_rel=2.0)
    system_a, system_b = list(range(100, 132)), list(range(200, 232))  # 8 blocks each
    assert send(router, "a1", system_a + [1, 2, 3, 4]).replica == 0
    assert send(router, "b1", system_b + [1, 2, 3, 4]).replica == 1
    route = send(router, "a2", system_a + [5, 6, 7, 8])
    assert (route.replica, route.reason, route.cached_blocks) == (0, "cache", 8)
    # replica 0 holds 72 tokens, replica 1 36: 36 above, within balance_abs_tokens=40
    assert send(router, "a3", system_a + [9, 9, 9, 9]).replica == 0
    # now 108 vs 36: more than 40 above and more than twice: the least loaded takes it
    route = send(router, "a4", system_a + [8, 8, 8, 8])
    assert (route.replica, route.reason, route.cached_blocks) == (1, "least_loaded", 0)
    # a prompt no replica holds a block of goes to the least loaded
    assert send(router, "c", list(range(300, 340))).reason == "least_loaded"


def test_least_loaded_ignores_cached_prefixes_but_a_conversation_sticks_to_its_replica():
    router = Router(2, "least_loaded", BS, capacity_blocks=100)
    turn1 = list(range(100, 110))
    assert send(router, "t1", turn1).replica == 0
    router.produced("t1", list(range(500, 512)))
    assert send(router, "other", list(range(600, 700))).replica == 1
    router.finished("t1")
    assert send(router, "big", list(range(1000, 1300))).replica == 0  # 0 holds 300 tokens, 1 holds 100
    turn2 = turn1 + list(range(500, 512)) + [7, 7, 7, 7]  # the history, then a new message
    route = send(router, "t2", turn2)
    assert (route.replica, route.reason) == (0, "history")
    # the same start without that history is routed by load alone
    route = send(router, "new", turn1 + [9] * 12)
    assert (route.replica, route.reason) == (1, "least_loaded")
    router.set_up(0, False)  # the history's replica failed: anywhere else, by load
    assert send(router, "t2-again", turn2).replica == 1


def test_failed_or_excluded_replicas_are_never_chosen():
    router = Router(3, "cache_aware", BS, capacity_blocks=100)
    prompt = list(range(40))
    assert send(router, 0, prompt).replica == 0
    router.finished(0)
    assert send(router, 1, prompt, exclude={0}).replica == 1  # a retry: not where it failed
    router.set_up(1, False)
    assert router.route(prompt, exclude={0, 2}) is None
    assert router.route(prompt).replica in (0, 2)
    router.set_up(0, False)
    router.set_up(2, False)
    assert router.route(prompt) is None


def test_salted_prompts_share_no_prefix_and_the_index_forgets_least_recently_used():
    assert prefix_hashes(list(range(8)), BS, None) != prefix_hashes(list(range(8)), BS, "tenant")
    assert prefix_hashes(list(range(7)), BS, None) == prefix_hashes(list(range(8)), BS, None)[:1]
    index = PrefixIndex(capacity_blocks=4)
    a, b = prefix_hashes(list(range(12)), BS, None), prefix_hashes(list(range(50, 62)), BS, None)
    index.add(a)
    assert index.match(a) == 3
    index.add(b)  # 6 blocks into 4: a's first two go
    assert len(index) == 4 and index.match(a) == 0 and index.match(b) == 3


def test_an_adapters_requests_go_where_it_was_served_and_its_prefixes_are_its_own():
    router = Router(2, "cache_aware", BS, capacity_blocks=100, balance_abs_tokens=40, balance_rel=2.0, max_loras=2)
    system = list(range(100, 132))
    first = router.route(system + [1], adapter="a")
    router.started("a1", first, system + [1], adapter="a")
    assert first.replica == 0
    # another adapter's request with the same prompt shares none of its blocks
    other = router.route(system + [2], adapter="b")
    assert (other.replica, other.reason, other.cached_blocks) == (1, "least_loaded", 0)
    router.started("b1", other, system + [2], adapter="b")
    # a new prompt of adapter "a" goes to the replica that served "a" (no prefix of it anywhere)
    route = router.route(list(range(500, 520)), adapter="a")
    assert (route.replica, route.reason) == (0, "adapter")
    # the same prompt of "a" finds its cached prefix on replica 0
    route = router.route(system + [3], adapter="a")
    assert (route.replica, route.reason, route.cached_blocks) == (0, "cache", 8)
    # within the overload bound only: replica 0 far above replica 1 sends "a" to the least loaded
    router.produced("a1", [1] * 200)
    assert router.route(list(range(600, 620)), adapter="a").reason == "least_loaded"
    # a replica remembers its last max_loras adapters; a failed one forgets them
    for name in ("c", "d"):
        router.started(name, router.route([7], exclude={1}, adapter=name), [7], adapter=name)
    assert list(router.adapters[0]) == ["c", "d"]
    router.set_up(0, False)
    assert not router.adapters[0]
