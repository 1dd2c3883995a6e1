"""Small networking helpers for the runtime: free ports and the address peers can reach us on.

``free_port`` asks the OS for an unused TCP port by binding port 0 and closing the socket; another
process could take it before we bind it again, a window accepted by every torch launcher.
``routable_address(peer)`` returns the local IP of the interface that routes to ``peer`` (a UDP
"connect" sends no packet), so a controller publishes an address the other ranks can actually reach.
"""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """An unused TCP port on ``host`` (all interfaces by default)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def routable_address(peer: str) -> str:
    """The local IP address used to reach ``peer`` (a host name or IP); loopback peers give loopback."""
    infos = socket.getaddrinfo(peer, 1, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])
