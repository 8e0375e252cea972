"""Where a benchmark's CPU time went, thread by thread, on the whole machine.

A fleet on Ray pays for Ray twice: in its daemons (GCS, raylets, agents) and in the C++ threads Ray's core
worker runs inside every process that joins the cluster (the replica actors and the router, a driver). With
one core per replica, every cycle either spends comes out of serving. `snapshot()` reads every thread's CPU
time from /proc; `account()` splits the difference between two snapshots into those two and the rest (the
engines, the router's own work, the load generator), so a local and a Ray cell can be set side by side.
"""

import os
from dataclasses import dataclass
from pathlib import Path

# Ray's daemons, by a word of their command line; replica actors ("ray::ReplicaActor") are not daemons.
RAY_DAEMON_WORDS = ("gcs_server", "raylet", "log_monitor", "dashboard", "monitor.py", "DashboardAgent",
                    "RuntimeEnvAgent")
# The threads Ray's core worker (C++, gRPC) starts in a process that joins a cluster, by their kernel names
# (15 characters at most). Read from a Ray 2.60 actor and driver; torch's and Python's threads carry other names.
RAY_THREAD_NAMES = frozenset({
    "client.poll0", "default-executo", "event_engine", "gcs_client_io_s", "global.accessor", "grpc_global_tim",
    "grpcpp_sync_ser", "nexting_thread", "resolver-execut", "server.poll0", "task_event_buff", "timer_manager",
    "worker.io", "worker.user_obj",
})
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ThreadTime:
    kind: str  # "ray_daemons", "ray_threads" or "serving"
    seconds: float


def _kind(cmdline: str, thread_name: str) -> str:
    if any(w in cmdline for w in RAY_DAEMON_WORDS) and "ReplicaActor" not in cmdline:
        return "ray_daemons"
    return "ray_threads" if thread_name in RAY_THREAD_NAMES else "serving"


def _thread(stat_path: Path, cmdline: str) -> ThreadTime | None:
    try:
        text = stat_path.read_text()
    except OSError:  # the thread or process ended between the listing and the read
        return None
    name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
    utime, stime = int(rest[11]), int(rest[12])  # fields 14 and 15 of proc(5), counted after the name
    return ThreadTime(_kind(cmdline, name), (utime + stime) / _TICK)


def snapshot(proc: Path = Path("/proc")) -> dict[tuple[int, int], ThreadTime]:
    """Every thread on the machine: (pid, tid) -> its kind and CPU seconds so far."""
    out: dict[tuple[int, int], ThreadTime] = {}
    for pdir in proc.iterdir():
        if not pdir.name.isdigit():
            continue
        try:
            cmdline = (pdir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            tids = [t.name for t in (pdir / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            t = _thread(pdir / "task" / tid / "stat", cmdline)
            if t is not None:
                out[int(pdir.name), int(tid)] = t
    return out


def account(before: dict[tuple[int, int], ThreadTime], after: dict[tuple[int, int], ThreadTime],
            wall_s: float) -> dict[str, float]:
    """CPU seconds by kind between two snapshots, and each kind's share of the machine's cores over `wall_s`.
    A thread that ended in between is not counted (its last seconds are lost with it)."""
    seconds = {"ray_daemons": 0.0, "ray_threads": 0.0, "serving": 0.0}
    for key, t in after.items():
        seconds[t.kind] += t.seconds - (before[key].seconds if key in before else 0.0)
    cores = (os.cpu_count() or 1) * wall_s
    return {**{f"{k}_cpu_s": v for k, v in seconds.items()},
            **{f"{k}_cpu_share": v / cores if cores else 0.0 for k, v in seconds.items()}}
