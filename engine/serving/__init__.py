"""The serving front: what turns client traffic into engine requests and back.

    zmq_frontend.py   the ZMQ ROUTER socket (typed msgspec frames), one I/O thread
    http_frontend.py  OpenAI's HTTP API (FastAPI on uvicorn, http_protocol.py's limits):
                      the completions and chat handlers; http_app.py (routes, API key, CORS,
                      errors), request_body.py (bounded parsing), openai_protocol.py
                      (requests), openai_shapes.py (responses), tokenize_api.py (/tokenize ...),
                      responses_api.py (/v1/responses over chat)
    structured_request.py  a request's response_format / structured_outputs / guided_* as
                      one constraint (engine/structured.py compiles it)
    tools/            tool calling: the model's call format, the prompt, forced calls
    tokenize_pool.py  tokenizing off the I/O threads, shortest first
    commands.py       what frontends hand the step loop, and the Frontend protocol
    frontends.py      the one assembly of a process's frontends from the config (ZMQ, HTTP)
    server.py         the step loop on the driver's main thread: commands in, steps, replies out
    metrics.py        Prometheus metrics of the engine and the HTTP server
    replicas/         several replicas behind one front door (parallel.data): the same
                      frontends, a router and a link to each replica's driver

The engine core (engine/*.py) imports nothing from here (tests/unit/test_layering.py).
"""
