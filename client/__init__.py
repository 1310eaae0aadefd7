"""Python clients for a meshserve server's ZMQ frontend. Imports no torch.

    from meshserve.client import Client
    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Hello", max_tokens=20, temperature=0).text)
        print(c.generate("A colour:", structured_outputs={"choice": ["red", "blue"]}).text)
"""

from meshserve.client.aio import AsyncClient
from meshserve.client.errors import MeshserveError, RequestTimeout, ServerUnreachable
from meshserve.client.sync import Client
from meshserve.comm.messages import Completion, Delta, StructuredOutputs

__all__ = ["AsyncClient", "Client", "Completion", "Delta", "MeshserveError", "RequestTimeout", "ServerUnreachable",
           "StructuredOutputs"]
