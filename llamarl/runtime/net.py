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


def routable_address(peer: str, family: socket.AddressFamily = socket.AF_INET) -> str:
    """The local IP address of ``family`` (the listener's: IPv4) used to reach ``peer`` (a host name or IP);
    loopback peers give loopback. Only addresses of ``family`` are looked up: ``localhost`` resolves to ::1
    first on many hosts (Debian, RHEL, containers), an address an IPv4 client cannot connect to."""
    try:
        infos = socket.getaddrinfo(peer, 1, family=family, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise OSError(f"{peer!r} has no {family.name} address ({e}); the controller listens on IPv4, so "
                      "MASTER_ADDR must name a host with an IPv4 address") from None
    _, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])
