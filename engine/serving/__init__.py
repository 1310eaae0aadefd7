"""The serving front: what turns client traffic into engine requests and back.

    zmq_frontend.py   the ZMQ ROUTER socket (typed msgspec frames), one I/O thread
    http_frontend.py  OpenAI's HTTP API (FastAPI on uvicorn, http_protocol.py's limits),
                      with request_body.py (bounded parsing) and openai_protocol.py (shapes)
    tokenize_pool.py  tokenizing off the I/O threads, shortest first
    commands.py       what frontends hand the step loop, and the Frontend protocol
    server.py         the step loop on the driver's main thread: commands in, steps, replies out
    metrics.py        Prometheus metrics of the engine and the HTTP server

The engine core (engine/*.py) imports nothing from here (tests/unit/test_layering.py).
"""
