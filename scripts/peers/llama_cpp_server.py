"""llama-cpp-python's OpenAI-compatible server, with the model parameter use_extra_bufts=False.

The stock CPU build dies with SIGILL in its AMX weight-repacking path on some CPUs (this
machine's among them), and neither the server's flags nor `Llama(...)` expose the switch, so
this wrapper sets it in the default model parameters, then runs the server's own main:

    python scripts/peers/llama_cpp_server.py --model FILE.gguf --n_threads 2 --interrupt_requests False --port 8001
"""

import llama_cpp.llama_cpp as llama_cpp_c

_default_params = llama_cpp_c.llama_model_default_params


def _params_without_extra_bufts():
    params = _default_params()
    params.use_extra_bufts = False
    return params


llama_cpp_c.llama_model_default_params = _params_without_extra_bufts

if __name__ == "__main__":
    from llama_cpp.server.__main__ import main

    main()
