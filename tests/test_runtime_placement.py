"""llamarl.runtime's placement: layouts and their rank assignment, group backends, the controller's address,
and the torchrun path (ranks simulated with subprocesses carrying torchrun's environment variables; the
controller's admission of them, strangers at its port included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from llamarl.runtime import (
    GeneratorSpec,
    Layout,
    LayoutError,
    RewardSpec,
    Runtime,
    TorchrunEnv,
    TrainerSpec,
)
from llamarl.runtime.admission import knock
from llamarl.runtime.launch import layout_rank
from llamarl.runtime.net import free_port

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ torchrun
@pytest.mark.parametrize("world", [3, 2])
def test_torchrun_path_with_simulated_ranks(world):
    """world 3: rank 0 the controller, 1 the trainer, 2 the generator; world 2 (shared rank 0): rank 0 the
    controller with the trainer in a child process, rank 1 the generator."""
    spec = "trainer=1,generator=1x1,reward=0"
    port = free_port("127.0.0.1")
    code = f"from llamarl.runtime.testing import torchrun_demo; torchrun_demo({spec!r})"
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONPATH=str(REPO))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world, outputs
    line = next(x for x in outputs[0].splitlines() if x.startswith("TORCHRUN_DEMO "))
    result = json.loads(line.split(" ", 1)[1])
    assert set(result) == {"trainer", "generator"}
    infos = [result[name]["info"][0] for name in ("trainer", "generator")]
    # each torchrun rank became rank 0 of its own one-rank process group, with its layout global rank
    assert [(i["group"], i["global_rank"], i["dist_rank"], i["dist_world_size"]) for i in infos] == [
        ("trainer", 1, 0, 1), ("generator", 2, 0, 1)]
    assert result["trainer"]["sum"] == [[1.0]] and result["generator"]["sum"] == [[1.0]]
    pids = [i["pid"] for i in infos]
    if world == 3:  # executors are the torchrun processes themselves
        assert pids == [procs[1].pid, procs[2].pid]
    else:  # the trainer runs in a child of rank 0, the generator is torchrun rank 1
        assert pids[1] == procs[1].pid and pids[0] not in (procs[0].pid, procs[1].pid)


def test_torchrun_rejects_a_layout_that_does_not_fit_world_size():
    layout = Layout.parse("trainer=2,generator=1,reward=0")  # 3 executor ranks: WORLD_SIZE 3 or 4
    for world in (2, 5):
        tr = TorchrunEnv(rank=0, world_size=world, local_rank=0, master_addr="127.0.0.1", master_port=free_port())
        with pytest.raises(LayoutError, match=rf"WORLD_SIZE=3 \(rank 0 also hosts the controller\) or 4 .*not {world}"):
            Runtime(layout, torchrun=tr)
    assert [layout_rank(layout, TorchrunEnv(r, 3, r, "a", 1)) for r in range(3)] == [0, 2, 3]
    assert [layout_rank(layout, TorchrunEnv(r, 4, r, "a", 1)) for r in range(4)] == [0, 1, 2, 3]


def test_stray_connections_to_the_controller_neither_abort_nor_block_the_start():
    """Strangers at the controller's port (a probe that connects and leaves, an HTTP health check, a client
    with another key, one that connects and stays silent) are dropped one by one, while the ranks get in:
    before, the first three aborted the start and the silent one held the accept until it left."""
    import datetime
    import pickle
    import socket

    from torch.distributed import TCPStore

    from llamarl.runtime.launch import STORE_KEY, Hello

    layout = Layout.parse("trainer=1,generator=1x1,reward=0")
    port, outcome = free_port("127.0.0.1"), {}

    def controller():
        try:
            outcome["runtime"] = Runtime(layout, torchrun=TorchrunEnv(0, 3, 0, "127.0.0.1", port), start_timeout_s=20)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    thread = threading.Thread(target=controller)
    thread.start()
    store = TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
    host, listen_port, key = store.get(STORE_KEY).decode().rsplit(":", 2)
    address = (host, int(listen_port))
    silent = socket.create_connection(address)  # stays connected, says nothing
    socket.create_connection(address).close()
    with socket.create_connection(address) as http:
        http.sendall(b"GET /health HTTP/1.0\r\n\r\n")
    with pytest.raises(ConnectionError, match="refused this rank's key"):
        knock(*address, b"wrong key")
    ranks = []
    try:
        for rank in (1, 2):
            ranks.append(knock(*address, bytes.fromhex(key)))
            ranks[-1].send_bytes(pickle.dumps(Hello(rank, rank, layout.spec, "here", free_port(), 0)))
        thread.join(timeout=60)
        assert "runtime" in outcome, outcome  # admitted while the silent stranger was still connected
    finally:
        silent.close()
        if "runtime" in outcome:
            outcome["runtime"].shutdown()
        for conn in ranks:
            conn.close()


def test_a_rank_knocking_at_a_silent_or_closed_port_fails_with_the_address():
    """A rank whose rendezvous store names a port that accepts and stays silent (a stale address, another
    service) fails after the handshake deadline naming the address; ``Client`` waited there for ever. A port
    nobody listens on, or one that closes mid-handshake, fails at once."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as silent:
        host, port = silent.getsockname()[:2]
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"controller at {host}:{port} .*accepted the connection but "
                           r"did not answer within 0.5 s"):
            knock(host, port, b"key", handshake_s=0.5)
        assert time.monotonic() - start < 10
    with socket.create_server(("127.0.0.1", 0)) as closing:
        closer = threading.Thread(target=lambda: closing.accept()[0].close())
        closer.start()
        with pytest.raises(ConnectionError, match=r"closed the connection during the handshake"):
            knock(*closing.getsockname()[:2], b"key", handshake_s=30)
        closer.join()
    with pytest.raises(ConnectionError, match=rf"cannot connect to the controller at {host}:{port}"):
        knock(host, port, b"key", handshake_s=5)


def test_torchrun_env_detection():
    assert TorchrunEnv.detect({}) is None
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert TorchrunEnv.detect(env) == TorchrunEnv(3, 8, 1, "node0", 29500)


# ------------------------------------------------------------------------------------------ placement
def test_layout_parse_and_rank_assignment():
    layout = Layout.parse("trainer=2,generator=2x1,reward=2")
    assert layout == Layout(TrainerSpec(2, "fsdp"), GeneratorSpec(tp=2, replicas=1), RewardSpec(2), "cpu")
    assert layout.world_size == 7 and Layout.parse(layout.spec) == layout
    assert [(g.name, g.global_ranks, g.backend) for g in layout.groups] == [
        ("trainer", (1, 2), "gloo"), ("generator", (3, 4), "gloo"), ("reward", (5, 6), "gloo")]
    assert layout.assignment(0).role == "controller"
    a = layout.assignment(4)
    assert (a.role, a.group.name, a.rank) == ("generator", "generator", 1)
    with pytest.raises(LayoutError, match="outside layout"):
        layout.assignment(7)

    multi = Layout.parse("trainer=4:ddp, generator=1x3, reward=0", device="cuda")
    assert [g.name for g in multi.groups] == ["trainer", "generator.0", "generator.1", "generator.2"]
    assert {g.backend for g in multi.groups} == {"nccl"} and multi.world_size == 8
    assert [g.global_ranks for g in multi.groups_of("generator")] == [(5,), (6,), (7,)]
    # local GPUs are handed out round-robin over accelerator ranks; torchrun uses LOCAL_RANK
    assert [multi.cuda_device(r, 4) for r in range(1, 8)] == [0, 1, 2, 3, 0, 1, 2]
    assert multi.cuda_device(6, 8, local_rank=5) == 5
    assert multi.cuda_device(0, 8) is None and layout.cuda_device(5, 8) is None
    assert Layout.parse("generator=4").generator == GeneratorSpec(tp=4, replicas=1)
    assert Layout.parse("trainer=2: DDP").trainer == TrainerSpec(2, "ddp")  # spaced and cased like the rest
    assert Layout.parse("reward=1,device=cuda").groups[-1].backend == "gloo"  # rewards stay on the CPU


@pytest.mark.parametrize("spec, message", [
    ("trainr=2", r"unknown role 'trainr'.*did you mean 'trainer'"),
    ("trainer=0", r"trainer.ranks: must be an integer >= 1, got 0"),
    ("trainer=2:zero", r"trainer.parallel: must be one of fsdp, ddp, none"),
    ("trainer=2:none", r"'none' needs exactly 1 rank"),
    ("generator=2xq", r"generator='2xq': 'q' is not a number; expected TPxREPLICAS"),
    ("reward=-1", r"reward.workers: must be an integer >= 0"),
    ("trainer=1,trainer=2", r"'trainer' is given twice"),
    ("trainer", r"not of the form key=value"),
    ("device=tpu", r"layout.device: must be one of cpu, cuda"),
])
def test_layout_errors_name_the_part(spec, message):
    with pytest.raises(LayoutError, match=message):
        Layout.parse(spec)


def test_ranks_sharing_a_gpu_talk_over_gloo(capsys):
    """NCCL refuses two ranks of one group on one GPU: such a group gets gloo, and says so."""
    from llamarl.runtime.launch import group_backend
    from llamarl.runtime.placement import GroupPlacement

    trainer = GroupPlacement("trainer", "trainer", (1, 2), "nccl", True)
    assert group_backend(trainer, ["cuda:0", "cuda:1"]) == "nccl"
    assert capsys.readouterr().err == ""
    assert group_backend(trainer, ["cuda:0", "cuda:0"]) == "gloo"
    assert "NCCL needs one GPU per rank" in capsys.readouterr().err
    cpu = GroupPlacement("generator", "generator", (3, 4), "gloo", False)
    assert group_backend(cpu, ["cpu", "cpu"]) == "gloo"
    # cuda:0 on two hosts is two GPUs (a torchrun group over nodes was put on gloo)
    four = GroupPlacement("trainer", "trainer", (1, 2, 3, 4), "nccl", True)
    assert group_backend(four, ["cuda:0", "cuda:1"] * 2, hosts=["a", "a", "b", "b"]) == "nccl"
    assert group_backend(four, ["cuda:0", "cuda:1"] * 2, hosts=["a"] * 4) == "gloo"
    # ranks that each see one GPU (their own CUDA_VISIBLE_DEVICES) all say cuda:0: the UUIDs tell them apart
    two = ["cuda:0", "cuda:0"]
    assert group_backend(trainer, two, hosts=["a", "a"], uuids=["GPU-1f", "GPU-2e"]) == "nccl"
    assert group_backend(trainer, two, hosts=["a", "a"], uuids=["GPU-1f", "GPU-1f"]) == "gloo"
    assert group_backend(trainer, two, hosts=["a", "a"], uuids=["GPU-1f", ""]) == "gloo"  # unknown: by index


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_torchrun_rank_names_its_gpus_by_uuid():
    """What group_backend tells GPUs apart by under per-rank CUDA_VISIBLE_DEVICES: one non-empty UUID per GPU."""
    from llamarl.runtime.launch import visible_gpu_uuids

    uuids = visible_gpu_uuids()
    assert len(uuids) == torch.cuda.device_count() and all(uuids) and len(set(uuids)) == len(uuids)


def test_the_controller_publishes_an_ipv4_address_for_localhost(monkeypatch):
    """torchrun --standalone sets MASTER_ADDR=localhost, which resolves to ::1 first on Debian, RHEL and in
    containers; the controller listens on IPv4, so the address it publishes must be one."""
    import socket

    from llamarl.runtime import net

    real = socket.getaddrinfo

    def ipv6_first(host, port, family=0, type=0, *args):
        v6 = [(socket.AF_INET6, socket.SOCK_DGRAM, 17, "", ("::1", port, 0, 0))]
        return (v6 if family in (0, socket.AF_INET6) else []) + real(host, port, family or socket.AF_INET, type)

    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    assert net.routable_address("localhost") == "127.0.0.1"
