"""Reading a ``multiprocessing`` connection's messages without ever blocking on a partial one.

``Connection.recv_bytes`` blocks until a whole message has arrived. The monitor thread of an executor group
(``executor.py``) must not: a rank stopped or cut off in the middle of a reply (SIGSTOP, a remote host whose
network died mid-send) would hold it in that read for good, and with it the hang detection and the death
detection of every other rank of the group. ``FrameReader`` takes what the socket holds now and returns the
messages that are complete; the rest of a partial one waits in its buffer for the next ``read``.

It reads through its own duplicate of the connection's descriptor with ``MSG_DONTWAIT``, a per-call flag:
the descriptor stays blocking for the threads that send on it (making it non-blocking would make their
``send_bytes`` fail with ``BlockingIOError`` whenever the peer's buffer is full). Every executor link is a
socket (a duplex ``multiprocessing.Pipe`` is a Unix socket pair; a torchrun rank's link is TCP).

Wire format (``multiprocessing.connection``'s): a message of n bytes is n as a 4-byte big-endian signed
integer, then the n bytes; above 2**31 - 1 bytes the 4 bytes hold -1 and an 8-byte big-endian unsigned n
follows. Invariant: after ``read`` returns, the buffer holds less than one whole message.
"""

from __future__ import annotations

import os
import socket
import struct
from multiprocessing.connection import Connection

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")


class FrameReader:
    """Whole messages from a connection as they become complete; never waits for more bytes."""

    def __init__(self, conn: Connection) -> None:
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._head = bytearray()  # header bytes received so far
        self._body: bytearray | None = None  # the message being received, once its header is complete
        self._filled = 0

    def read(self) -> tuple[list[bytearray], bool]:
        """(the messages completed by what the socket holds now, in order; whether the peer has closed).

        Closed means end of file or a connection error (reset, or this reader closed): no more messages
        will come. A partial message is kept for the next call, or dropped with the connection."""
        messages: list[bytearray] = []
        try:
            while True:
                if self._body is None:
                    chunk = self._sock.recv(self._header_missing(), socket.MSG_DONTWAIT)
                    if not chunk:
                        return messages, True
                    self._head += chunk
                    self._start_body()
                else:
                    view = memoryview(self._body)[self._filled:]
                    got = self._sock.recv_into(view, len(view), socket.MSG_DONTWAIT) if len(view) else 0
                    if len(view) and not got:
                        return messages, True
                    self._filled += got
                if self._body is not None and self._filled == len(self._body):
                    messages.append(self._body)
                    self._body, self._filled = None, 0
        except (BlockingIOError, InterruptedError):
            return messages, False  # nothing more for now
        except OSError:
            return messages, True

    def _header_missing(self) -> int:
        """Bytes still needed to know the size of the next message."""
        if len(self._head) < _SHORT.size:
            return _SHORT.size - len(self._head)
        return _SHORT.size + _LONG.size - len(self._head)  # the head said -1: an 8-byte size follows

    def _start_body(self) -> None:
        """Once the header is complete, allocate the message it announces."""
        if len(self._head) < _SHORT.size:
            return
        (size,) = _SHORT.unpack_from(self._head)
        if size == -1:
            if len(self._head) < _SHORT.size + _LONG.size:
                return
            (size,) = _LONG.unpack_from(self._head, _SHORT.size)
        elif size < 0:
            raise ConnectionError(f"corrupt message header on an executor link (size {size})")
        self._head.clear()
        self._body, self._filled = bytearray(size), 0

    def close(self) -> None:
        self._sock.close()
