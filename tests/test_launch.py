"""The launcher's safety: nothing listens beyond loopback on one machine, and the root cause of a failed
job is the failing rank's own report, not the timeouts it caused in the others."""

from __future__ import annotations

import os
from pathlib import Path

from tessera.launch.failures import EXIT_BAD_INPUT, EXIT_COLLECTIVE_TIMEOUT, EXIT_RUNTIME_FAULT, RankReport
from tessera.launch.jobs import Launch, _environment, _root_cause, _torchrun_command
from tessera.testing import run_ranks


def _listening_addresses() -> list[str]:
    """Local addresses of the TCP sockets this process listens on (from /proc, matched by inode)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address = fields[1].split(":")[0]
                found.append(
                    ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)) if len(address) == 8 else address
                )
    return found


def listening_after_a_collective() -> list[str]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return _listening_addresses()


def test_store_and_gloo_listen_on_loopback_only() -> None:
    """rank 0's store (torch's own server would listen on every interface) and gloo's pair sockets."""
    per_rank = run_ranks(listening_after_a_collective, 2)
    assert per_rank[0], "rank 0 should be listening (the store)"
    for rank, addresses in enumerate(per_rank):
        assert addresses and all(a == "127.0.0.1" for a in addresses), f"rank {rank} listens on {addresses}"


def test_one_machine_launch_has_no_network_rendezvous(tmp_path: Path) -> None:
    job = Launch(["config.yaml"], tmp_path / "run", nproc=2)
    cmd, env = _torchrun_command(job, tmp_path), _environment(job, tmp_path)
    assert "--standalone" not in cmd and "--rdzv-conf=store_type=file" in cmd and "--local-addr=127.0.0.1" in cmd
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and env["TESSERA_RUN_ID"]
    several = Launch(["config.yaml"], tmp_path / "run", nproc=2, nnodes=2, rdzv_endpoint="10.0.0.1:29400")
    assert "--rdzv-endpoint=10.0.0.1:29400" in _torchrun_command(several, tmp_path)
    # several machines: the interfaces are the user's to choose (nothing is forced to loopback)
    assert _environment(several, tmp_path).get("GLOO_SOCKET_IFNAME") == os.environ.get("GLOO_SOCKET_IFNAME")


def _rendezvous_listeners(create_handler, backend: str, endpoint: str) -> list[str]:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    params = RendezvousParameters(backend, endpoint, "listen-test", 1, 1, is_host="true")
    handler = create_handler(params)
    try:
        return _listening_addresses()
    finally:
        handler.shutdown()


def test_several_machines_rendezvous_store_listens_on_the_endpoint_address_only() -> None:
    """torchrun's c10d store serves every interface; tessera-c10d binds the endpoint's address.

    127.0.0.2 is a loopback address that is not 127.0.0.1, so a socket bound there is told apart
    from one bound everywhere (0.0.0.0)."""
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler

    from tessera.launch.torchrun import bound_c10d_handler

    bound = _rendezvous_listeners(bound_c10d_handler, "tessera-c10d", "127.0.0.2:0")
    assert bound == ["127.0.0.2"], bound
    stock = _rendezvous_listeners(_create_c10d_handler, "c10d", "127.0.0.2:0")
    assert "0.0.0.0" in stock or "00000000000000000000000000000000" in stock, stock  # what torch does
    several = Launch(["config.yaml"], Path("run"), nproc=2, nnodes=2, rdzv_endpoint="10.0.0.1:29400")
    assert "--rdzv-backend=tessera-c10d" in _torchrun_command(several, Path("private"))


def _report(rank: int, code: int, t: float, attempt: int = 0) -> RankReport:
    return RankReport(rank, attempt, code, f"rank {rank} says {code}", "Traceback ...", t)


def test_the_root_cause_is_a_real_error_before_the_timeouts_it_caused() -> None:
    timeout0 = _report(0, EXIT_COLLECTIVE_TIMEOUT, 1.0)
    oom1 = _report(1, EXIT_RUNTIME_FAULT, 2.0)
    assert _root_cause([timeout0, oom1]) is oom1
    assert _root_cause([timeout0, _report(1, EXIT_COLLECTIVE_TIMEOUT, 2.0)]) is timeout0
    older = _report(1, EXIT_BAD_INPUT, 0.5, attempt=0)
    assert _root_cause([older, _report(0, EXIT_COLLECTIVE_TIMEOUT, 3.0, attempt=1)]).attempt == 1
    assert _root_cause([]) is None


def _explained(tmp_path: Path, reports: list[RankReport], vanished: set[tuple[int, int]]) -> tuple[int, str]:
    import json
    from dataclasses import asdict

    from tessera.launch.jobs import Watcher, _explain

    folder = tmp_path / "job"
    folder.mkdir()
    for r in reports:
        (folder / f"rank{r.rank}.{r.attempt}.json").write_text(json.dumps(asdict(r)))
    (folder / "torchrun.log").write_text("torchrun output\n")
    watcher = Watcher(folder)
    watcher.vanished = vanished
    return _explain(Launch([], tmp_path / "run", nproc=2), folder, watcher, folder / "torchrun.log")


def test_a_rank_that_died_silently_is_the_cause_of_the_lost_connection(tmp_path: Path) -> None:
    lost = _report(0, EXIT_COLLECTIVE_TIMEOUT, 1.0)
    lost.peer_lost = True
    code, message = _explained(tmp_path, [lost], {(0, 1)})
    assert code == EXIT_RUNTIME_FAULT and message.startswith("rank 1 ended without reporting an error"), message
    assert (tmp_path / "run" / "logs").is_dir() and "Full tracebacks: " + str(tmp_path / "run" / "logs") in message


def test_a_timeout_stays_the_cause_when_the_hung_rank_is_stopped_afterwards(tmp_path: Path) -> None:
    code, message = _explained(tmp_path, [_report(0, EXIT_COLLECTIVE_TIMEOUT, 1.0)], {(0, 1)})
    assert code == EXIT_COLLECTIVE_TIMEOUT and message.startswith("rank 0 says 3. Then rank 1 ended"), message


def test_the_command_line_reaches_the_launch(tmp_path: Path, monkeypatch) -> None:
    """Every torchrun flag of `tessera train` arrives in the Launch (--local-addr was once parsed and dropped)."""
    import yaml
    from test_bad_input import GOOD

    import tessera.launch.commands as launch_module
    from tessera.cli import main

    jobs: list[Launch] = []
    monkeypatch.setattr(launch_module, "launch", lambda job: jobs.append(job) or 0)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**GOOD, "logging": {**GOOD["logging"], "out_dir": str(tmp_path / "runs")}}))
    argv = ["train", str(config), "--nproc", "2", "--nnodes", "2", "--max-restarts", "1"]
    argv += ["--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "j7", "--local-addr", "10.0.0.2"]
    assert main(argv) == 0
    (job,) = jobs
    assert (job.nproc, job.nnodes, job.max_restarts) == (2, 2, 1)
    assert (job.rdzv_endpoint, job.rdzv_id, job.local_addr) == ("10.0.0.1:29400", "j7", "10.0.0.2")
    assert "--local-addr=10.0.0.2" in _torchrun_command(job, tmp_path)


def test_a_several_machines_launch_trains_through_the_bound_rendezvous(tmp_path: Path) -> None:
    """torchrun accepts tessera-c10d end to end (it checks the backend's name against the flag's),
    on a second loopback address standing in for the head node."""
    import socket
    import subprocess
    import sys

    import yaml
    from test_bad_input import GOOD

    with socket.socket() as probe:  # a free port on 127.0.0.2
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**GOOD, "logging": {**GOOD["logging"], "out_dir": str(tmp_path / "runs")}}))
    argv = ["train", str(config), "--nproc", "2", "--rdzv-endpoint", f"127.0.0.2:{port}", "--local-addr", "127.0.0.2"]
    proc = subprocess.run([sys.executable, "-m", "tessera.cli", *argv], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "over steps 1-2" in proc.stdout, proc.stdout + proc.stderr


def test_a_plain_process_s_one_rank_group_leaves_no_rank_variables_behind() -> None:
    """tessera.init() outside a launch makes a one-rank group without writing RANK, LOCAL_RANK or MASTER_PORT
    into os.environ: a `tessera train` started from that process (a notebook's `!tessera train`) once took
    LOCAL_RANK for its own and ran as a rank instead of launching."""
    import subprocess
    import sys

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    script = (
        "import os, tessera, torch.distributed as dist; tessera.init(); "
        "assert (dist.get_rank(), dist.get_world_size()) == (0, 1); "
        f"print(sorted(k for k in {names!r} if k in os.environ))"
    )
    env = {k: v for k, v in os.environ.items() if k not in names}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


def test_machines_given_node_ranks_take_the_plan_s_ranks_whatever_order_the_rendezvous_gives(tmp_path: Path) -> None:
    """Two machines (loopback addresses) of one rank each, launched as `tessera plan` prints them: the plan
    puts machine m0 first, the rendezvous (which orders machines by address) puts m1's 127.0.0.2 before
    m0's 127.0.0.3. Each rank takes its plan rank from --node-rank, and the job trains; a rank that kept the
    rendezvous's order would report it."""
    import socket
    import subprocess
    import sys

    import yaml
    from test_bad_input import GOOD

    from tessera import Plan

    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]
    Plan(dp=2, rank_devices=("m0:0:cpu", "m1:0:cpu")).save(tmp_path / "plan.yaml", world_size=2)
    config = tmp_path / "c.yaml"
    runs = str(tmp_path / "runs")
    config.write_text(yaml.safe_dump({**GOOD, "plan": {"file": str(tmp_path / "plan.yaml")},
                                      "logging": {**GOOD["logging"], "out_dir": runs}}))  # fmt: skip
    machines = []
    for node_rank, addr in ((0, "127.0.0.3"), (1, "127.0.0.2")):
        argv = ["train", str(config), "--nproc", "1", "--nnodes", "2", "--node-rank", str(node_rank),
                "--rdzv-endpoint", f"127.0.0.2:{port}", "--local-addr", addr]  # fmt: skip
        env = {**os.environ, "TESSERA_LOG_LEVEL": "debug"}
        machines.append(subprocess.Popen([sys.executable, "-m", "tessera.cli", *argv], stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, env=env))  # fmt: skip
    outputs = [m.communicate(timeout=240)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], "\n".join(outputs)
    for node_rank, out in enumerate(outputs):
        # (the reverse of the rendezvous's: torch's c10d numbers machines by address)
        assert f"machine {node_rank} of the plan: ranks {node_rank}..{node_rank} (the rendezvous had numbered " \
               f"this one's first rank {1 - node_rank})" in out, out  # fmt: skip
