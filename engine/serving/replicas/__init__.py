"""Several replicas behind one front door (parallel.data > 1).

    routing.py      which replica takes a request: least loaded, or cache aware, and
                    conversations stick to the replica holding their history
    prefix_index.py what the front door believes each replica's prefix cache holds
    link.py         the front door's ZMQ connection to one replica's driver
    front_door.py   the front door's loop: frontends' requests to replicas, replies back,
                    a failed replica taken out (its requests retried or failed)
"""
