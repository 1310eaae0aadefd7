"""The step loop's drain on a stop: a request the frontend accepted before the stop is served
to its end (not dropped with the loop), a stop `now` aborts it with a final delta, and a
command that reaches the inbox after the last step is answered `unavailable`. A real engine
on one rank; the frontend records what the loop sends."""

from __future__ import annotations

from meshserve.comm.messages import Delta, ErrorReply, SamplingParams
from meshserve.engine.serving.commands import AddCommand, Inbox, RequestKey
from meshserve.engine.serving.server import Server
from support.engines import make_engine


class RecordingFrontend:
    tag = "rec"

    def __init__(self):
        self.accepting, self.error, self.sent = True, None, []

    def start(self) -> None:
        pass

    def send(self, key, message) -> None:
        self.sent.append((key, message))

    def send_all(self, replies) -> None:
        self.sent.extend(replies)

    def fail(self, keys, message) -> None:
        raise AssertionError(f"no failure expected: {message}")

    def close(self) -> None:
        pass


def _add(request_id: str, max_tokens: int = 12) -> AddCommand:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return AddCommand(RequestKey("rec", b"client", request_id), request_id, [5, 6, 7, 8, 9], params, stream=True)


def _server(tiny_checkpoints) -> tuple[Server, Inbox, RecordingFrontend]:
    inbox, frontend = Inbox(), RecordingFrontend()
    return Server(make_engine(tiny_checkpoints["llama"]), inbox, [frontend], 16, 4096), inbox, frontend


def _finals(frontend: RecordingFrontend) -> dict[str, Delta | ErrorReply]:
    return {key.request_id: m for key, m in frontend.sent if isinstance(m, ErrorReply) or m.finish_reason}


def test_a_request_accepted_before_the_stop_is_served_to_its_end(tiny_checkpoints):
    server, inbox, frontend = _server(tiny_checkpoints)
    inbox.put(_add("a"))
    inbox.put(_add("b", 3))
    server.request_stop()
    server.run(drain_timeout=60)
    finals = _finals(frontend)
    assert {k: m.finish_reason for k, m in finals.items()} == {"a": "length", "b": "length"}
    tokens = [t for key, m in frontend.sent if key.request_id == "a" for t in m.token_ids]
    assert len(tokens) == 12
    assert not server.engine.has_work()


def test_a_stop_now_aborts_with_a_final_delta(tiny_checkpoints):
    server, inbox, frontend = _server(tiny_checkpoints)
    inbox.put(_add("a", 200))
    server.request_stop(now=True)
    server.run(drain_timeout=60)
    assert _finals(frontend)["a"].finish_reason == "abort"


def test_a_command_after_the_last_step_is_answered_unavailable(tiny_checkpoints):
    server, inbox, frontend = _server(tiny_checkpoints)
    server.request_stop()
    server.run(drain_timeout=60)
    inbox.put(_add("late"))  # a prompt whose tokenizing ended during the drain
    server._refuse_late_commands()
    late = _finals(frontend)["late"]
    assert isinstance(late, ErrorReply) and late.code == "unavailable"
