"""The controller's door for torchrun ranks: a TCP listener whose handshakes run one per connection.

``multiprocessing.connection.Listener.accept`` runs the authkey challenge inside ``accept()``, so one stray
client (a port probe, an HTTP health check, a client that connects and stays silent) fails the accept or
holds it, and with it every real rank behind. Here ``accept()`` only accepts; each connection's challenge
(both ways, as ``Listener`` and ``Client`` run it) and its first message run on a thread of their own, and
a connection that has not passed within ``handshake_s`` is shut down. What passes goes to ``arrivals`` as
(connection, first message, peer address); what fails is dropped with one line on stderr. A failure of the
listener itself goes to ``arrivals`` as the exception.

``knock`` is the rank's side: ``Client``'s connect and challenges, bounded by the same deadline, so a rank
whose rendezvous store names something that accepts and stays silent (a stale address, another service on
the port, a controller stopped mid-start) fails with a message instead of blocking in ``Client`` for ever.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge

from llamarl.runtime.links import shutdown_socket
from llamarl.runtime.rpc import recv

HANDSHAKE_S = 30.0  # a rank answers in milliseconds; a silent stranger is dropped after this
BACKLOG = 128  # ranks connect at once: the default backlog of 1 leaves them to SYN retries (1 s, 3 s, ...)


class Door:
    """Listens on all interfaces (IPv4) at ``port``; admitted connections arrive on ``arrivals``."""

    def __init__(self, authkey: bytes, arrivals: queue.SimpleQueue, handshake_s: float = HANDSHAKE_S):
        self._listener = Listener(("", 0), family="AF_INET", backlog=BACKLOG)  # no authkey: the handshake is ours
        self.port = int(self._listener.address[1])
        self._authkey, self._arrivals, self._handshake_s = authkey, arrivals, handshake_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="llamarl-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception as exc:  # noqa: BLE001 - the listener itself failed: the waiting side reports it
                if not self._closed.is_set():
                    self._arrivals.put(exc)
                return
            if self._closed.is_set():  # the wake-up connection of close()
                conn.close()
                return
            peer = self._listener.last_accepted[0]
            threading.Thread(target=self._admit, args=(conn, peer), name="llamarl-admit", daemon=True).start()

    def _admit(self, conn: Connection, peer: str) -> None:
        timer = threading.Timer(self._handshake_s, shutdown_socket, (conn,))  # wakes a read of a silent client
        timer.daemon = True
        timer.start()
        try:
            deliver_challenge(conn, self._authkey)
            answer_challenge(conn, self._authkey)
            first = recv(conn)
        except Exception as exc:  # noqa: BLE001 - a stranger: no key, another protocol, silence, a reset
            print(f"llamarl.runtime: dropped a connection from {peer} to the controller that failed its handshake "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
            conn.close()
            return
        finally:
            timer.cancel()
        self._arrivals.put((conn, first, peer))

    def close(self) -> None:
        """Stop accepting (a connection to itself wakes the blocked accept) and close the listener."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._listener.close()


def knock(host: str, port: int, authkey: bytes, handshake_s: float = HANDSHAKE_S) -> Connection:
    """Connect to the controller's door at ``host:port`` and pass the challenges (as ``Client`` does: answer,
    then deliver); ConnectionError naming the address if either takes longer than ``handshake_s``, the
    connection is refused, or the key does not match."""
    where = f"the controller at {host}:{port} (from the rendezvous store)"
    try:
        sock = socket.create_connection((host, port), timeout=handshake_s)
    except OSError as exc:
        raise ConnectionError(f"cannot connect to {where}: {exc}; did the controller (global rank 0) "
                              "stop?") from exc
    sock.settimeout(None)
    conn = Connection(sock.detach())
    fired = threading.Event()

    def cut() -> None:
        fired.set()
        shutdown_socket(conn)

    timer = threading.Timer(handshake_s, cut)  # wakes the read of a silent controller
    timer.daemon = True
    timer.start()
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except AuthenticationError as exc:
        conn.close()
        raise ConnectionError(f"{where} refused this rank's key ({exc}): is the store shared with another "
                              "job? give each job its own MASTER_PORT") from exc
    except (OSError, EOFError) as exc:
        conn.close()
        what = (f"accepted the connection but did not answer within {handshake_s:g} s" if fired.is_set() else
                f"closed the connection during the handshake ({type(exc).__name__}: {exc})")
        raise ConnectionError(f"{where} {what}: a stale address in the store, or another service on that "
                              "port? restart the whole job") from exc
    finally:
        timer.cancel()
    return conn
