"""free_port hands each port out once per process: two children given ports before either binds
must not get the same one (a flaky "Address already in use" at cluster start)."""

from pdq.ops.redis_server import free_port


def test_free_port_never_repeats_within_a_process():
    ports = [free_port() for _ in range(300)]  # none bound in between, as when a cluster starts
    assert len(set(ports)) == len(ports)
    assert all(20000 <= p < 32768 for p in ports)



def test_a_held_port_is_refused_to_other_processes_but_a_server_of_the_child_binds_it():
    """free_port(hold=True) keeps the port bound (not listening) until release_port: another
    process's free_port cannot take it while the child starts, and the child's server (gRPC sets
    SO_REUSEADDR) binds it all the same; released, it is an ordinary free port again."""
    import socket
    import subprocess
    import sys
    from concurrent import futures

    import grpc

    from pdq.ops.redis_server import release_port

    port = free_port(hold=True)
    probe = ("import socket, sys\nwith socket.socket() as s:\n    try:\n        s.bind(('127.0.0.1', int(sys.argv[1])))\n"
             "    except OSError:\n        print('taken')\n    else:\n        print('free')\n")
    other = subprocess.run([sys.executable, "-c", probe, str(port)], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == "taken"  # what another process's free_port tries first
    server = grpc.server(futures.ThreadPoolExecutor(1))
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the child's server is the one listening
    finally:
        server.stop(0).wait()
    release_port(port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
